"""``state_source = "auto"``: find out what load state a replica publishes, then read it.

The probe asks, in order: ``GET /kvguard/state`` (a kvguard engine: a JSON object with its
``running`` sequences; such an engine is then read over its ``/kvguard/state/stream`` when it
offers one and the stream's first full document comes within the timeout — choice
``stream``, the cheapest source: one connection, only what changed — and polled otherwise,
choice ``kvguard``), then ``GET /metrics`` (a vLLM, SGLang, TGI or llama.cpp page, told
apart by its metric names and read once to be sure it parses), then ``GET /slots`` (a
llama.cpp server started without ``--metrics``). Where neither gives load the
replica is read as publishing nothing, and its concurrency limit is learned from its responses
(:mod:`guard.replicas.learned_limits`); the probe is repeated every ``reprobe_s`` in case the
engine starts exporting later. The choice and its reason are logged once per change and kept
on the source (``choice``, ``reason``) for the proxy's ``/kvguard/state``.

A probe that cannot reach the replica at all raises, like any failed refresh (the poller
counts it towards unhealthy), and the next refresh probes again. A chosen stream whose
replica later answers 404 on it (an engine replaced by one without the route) is dropped
and the replica probed again at the next refresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from guard.errors import StateUnavailable
from guard.replicas.engine_metrics import (
    detect_metrics_engine,
    parse_engine_metrics,
    parse_llamacpp_slots,
)
from guard.replicas.poller import HttpStateSource, StateClient, _state_document
from guard.replicas.state_stream import StreamStateSource
from guard.replicas.vllm_metrics import parse_vllm_metrics

__all__ = ["AutoStateSource", "LEARNED", "STREAM"]

log = logging.getLogger(__name__)

LEARNED = "learned"  # the choice when the replica publishes nothing readable
STREAM = "stream"  # the choice for a kvguard engine that streams its state


class AutoStateSource:
    """Probes a replica once (again every ``reprobe_s`` while nothing was found), then reads
    the source it found. ``kind`` is that source's (``none`` while learning)."""

    def __init__(self, url: str, *, client: StateClient, timeout_s: float = 1.0,
                 max_model_len: int | None = None, replica_id: str = "",
                 reprobe_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 stream_interval_ms: int = 100, stream_phase: float | None = None):
        if not reprobe_s > 0:
            raise ValueError(f"reprobe_s: must be > 0, got {reprobe_s!r}")
        self.url = url.rstrip("/")
        self.max_model_len = max_model_len
        self.replica_id = replica_id
        self._client = client
        self._timeout_s = timeout_s
        self._reprobe_s = reprobe_s
        self._clock = clock
        self._stream_interval_ms = stream_interval_ms
        self.stream_phase = stream_phase  # StreamStateSource's phase, if it streams
        self._source: HttpStateSource | StreamStateSource | None = None
        self._listener: Any = None  # the poller's, handed to a chosen stream
        self._probed_s: float | None = None
        self.kind = "none"
        self.choice: str | None = None  # None until the first probe answered
        self.reason = "not probed yet"

    async def fetch(self) -> Any:
        now_s = self._clock()
        if self._source is None and (self._probed_s is None
                                     or now_s - self._probed_s >= self._reprobe_s):
            await self._probe()
            self._probed_s = now_s
        if self._source is None:
            raise StateUnavailable(f"state_source auto: {self.reason}")
        source = self._source
        try:
            return await source.fetch()
        except StateUnavailable:
            if source is self._source and isinstance(source, StreamStateSource):
                self._source, self._probed_s, self.kind = None, None, "none"
                await source.aclose()  # the route went away: probe again next refresh
            raise

    @property
    def stream(self) -> StreamStateSource | None:
        """The state stream read, when that is the choice (its counts go to the proxy's
        ``/kvguard/state``)."""
        return self._source if isinstance(self._source, StreamStateSource) else None

    @property
    def answers_now(self) -> bool:
        """Whether :meth:`fetch` answers without waiting on anything (a chosen stream that
        does: no probe, no poll)."""
        return getattr(self._source, "answers_now", False)

    def listen(self, listener: Any) -> None:
        """The poller's push hook: handed to the stream once one is chosen."""
        self._listener = listener
        if isinstance(self._source, StreamStateSource):
            self._source.listen(listener)

    async def aclose(self) -> None:
        """Close a chosen stream; a later fetch probes again."""
        source = self._source
        if isinstance(source, StreamStateSource):
            self._source, self._probed_s, self.kind = None, None, "none"
            await source.aclose()

    async def _probe(self) -> None:
        choice, reason = await self._find()
        if choice == "kvguard":
            choice, reason = await self._stream(reason)
        elif choice != LEARNED:
            self._source = HttpStateSource(self.url, choice, client=self._client,
                                           timeout_s=self._timeout_s,
                                           max_model_len=self.max_model_len)
            self.kind = choice
        if (choice, reason) != (self.choice, self.reason):
            log.log(logging.INFO if choice != LEARNED else logging.WARNING,
                    "replica %s (%s): state_source auto chose %s: %s",
                    self.replica_id, self.url, choice, reason)
        self.choice, self.reason = choice, reason

    async def _stream(self, reason: str) -> tuple[str, str]:
        """A kvguard engine: its state stream when it offers one, else ``/kvguard/state``
        polled."""
        stream = StreamStateSource(self.url, interval_ms=self._stream_interval_ms,
                                   timeout_s=self._timeout_s, phase=self.stream_phase)
        try:
            why = await stream.opened(self._timeout_s)
        except BaseException:  # cancelled while waiting: its reader task ends too
            await stream.aclose()
            raise
        if why is None:
            if self._listener is not None:
                stream.listen(self._listener)
            self._source, self.kind = stream, stream.kind
            return STREAM, f"{reason}; /kvguard/state/stream streams its changes"
        await stream.aclose()
        self._source = HttpStateSource(self.url, "kvguard", client=self._client,
                                       timeout_s=self._timeout_s,
                                       max_model_len=self.max_model_len)
        self.kind = "kvguard"
        return "kvguard", f"{reason}; no state stream ({why}): polled"

    async def _find(self) -> tuple[str, str]:
        """``(choice, reason)``: a state source kind, or ``LEARNED``."""
        response = await self._client.get(self.url + "/kvguard/state", timeout=self._timeout_s)
        if response.status_code == 200:
            try:
                state = _state_document(response.content, "/kvguard/state")
            except StateUnavailable:
                state = None
            if isinstance(state, dict) and "running" in state:
                return "kvguard", "/kvguard/state answers with the engine's sequences"
        state_note = f"/kvguard/state answered {response.status_code}"
        response = await self._client.get(self.url + "/metrics", timeout=self._timeout_s)
        if response.status_code != 200:
            return await self._slots(f"{state_note}, /metrics answered {response.status_code}")
        text = response.text
        engine = detect_metrics_engine(text)
        if engine is None:
            return await self._slots(
                f"{state_note}, /metrics has no vLLM, SGLang, TGI or llama.cpp gauges")
        try:
            if engine == "vllm":
                parse_vllm_metrics(text)
            else:
                parse_engine_metrics(engine, text)
        except ValueError as exc:
            return LEARNED, f"{state_note}, /metrics looks like {engine} but: {exc}"
        return engine, f"{state_note}, /metrics has {engine}'s load gauges"

    async def _slots(self, note: str) -> tuple[str, str]:
        """No load in ``/metrics``: llama.cpp's ``/slots`` still gives the slots, else learn."""
        response = await self._client.get(self.url + "/slots", timeout=self._timeout_s)
        if response.status_code == 200:
            try:
                parse_llamacpp_slots(response.text)
            except ValueError:
                pass
            else:
                return "llamacpp", f"{note}; /slots lists llama.cpp's slots"
        return LEARNED, f"{note}, /slots answered {response.status_code}"
