"""``state_source = "auto"``: find out what load state a replica publishes, then read it.

The probe asks, in order: ``GET /kvguard/state`` (a kvguard engine: a JSON object with its
``running`` sequences), then ``GET /metrics`` (a vLLM, SGLang, TGI or llama.cpp page, told
apart by its metric names and read once to be sure it parses), then ``GET /slots`` (a
llama.cpp server started without ``--metrics``). Where neither gives load the
replica is read as publishing nothing, and its concurrency limit is learned from its responses
(:mod:`guard.replicas.learned_limits`); the probe is repeated every ``reprobe_s`` in case the
engine starts exporting later. The choice and its reason are logged once per change and kept
on the source (``choice``, ``reason``) for the proxy's ``/kvguard/state``.

A probe that cannot reach the replica at all raises, like any failed refresh (the poller
counts it towards unhealthy), and the next refresh probes again.
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
from guard.replicas.vllm_metrics import parse_vllm_metrics

__all__ = ["AutoStateSource", "LEARNED"]

log = logging.getLogger(__name__)

LEARNED = "learned"  # the choice when the replica publishes nothing readable


class AutoStateSource:
    """Probes a replica once (again every ``reprobe_s`` while nothing was found), then reads
    the source it found. ``kind`` is that source's (``none`` while learning)."""

    def __init__(self, url: str, *, client: StateClient, timeout_s: float = 1.0,
                 max_model_len: int | None = None, replica_id: str = "",
                 reprobe_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if not reprobe_s > 0:
            raise ValueError(f"reprobe_s: must be > 0, got {reprobe_s!r}")
        self.url = url.rstrip("/")
        self.max_model_len = max_model_len
        self.replica_id = replica_id
        self._client = client
        self._timeout_s = timeout_s
        self._reprobe_s = reprobe_s
        self._clock = clock
        self._source: HttpStateSource | None = None
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
        return await self._source.fetch()

    async def _probe(self) -> None:
        choice, reason = await self._find()
        if choice != LEARNED:
            self._source = HttpStateSource(self.url, choice, client=self._client,
                                           timeout_s=self._timeout_s,
                                           max_model_len=self.max_model_len)
            self.kind = choice
        if (choice, reason) != (self.choice, self.reason):
            log.log(logging.INFO if choice != LEARNED else logging.WARNING,
                    "replica %s (%s): state_source auto chose %s: %s",
                    self.replica_id, self.url, choice, reason)
        self.choice, self.reason = choice, reason

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
