"""``state_source = "stream"``: a kvguard replica's state over one long-lived response.

:class:`StreamStateSource` holds ``GET {url}/kvguard/state/stream?interval_ms=N`` open
(:mod:`serving.state_delta` is the protocol: a full compact document, then deltas numbered
one by one) and keeps the replica's compact document up to date by applying each delta, so a
state refresh costs what changed on the wire instead of a request and a whole document per
poll. The poller hands each event to the guard's view as it arrives (:meth:`listen`; applied
in its batch of a few milliseconds: :class:`~guard.replicas.poller.StatePoller`), so the view
is as fresh as the stream; its rounds still call :meth:`fetch`, which returns the
document as of the latest event, :data:`UNCHANGED` when events arrived but changed nothing
but the replica's clock (its view is then only marked fresh), or None when no event arrived
since the round before (the view stands, and ages).

A **resync** (a new stream, whose first event is a full document) happens when an event's
``seq`` is not the next one (a lost delta), when the stream ends or breaks (a restarted
replica ends its streams), or when no event arrived for ``stale_after_s``; ``num_resyncs``
counts them and ``num_gaps`` the lost deltas among them. Until a stream delivers its full
document, :meth:`fetch` raises (the poller counts the replica's errors as for any source).
A replica that answers 404 has no stream: :class:`guard.errors.StateUnavailable`, as for
``/kvguard/state``.

The stream is asked for the replica's fit of its own step time instead of the iteration
samples (``&fit=1``, :mod:`serving.step_time_fit`): the document's ``step_time_fit``, which
:class:`~guard.replicas.load_state.LoadState` takes as the replica's model, with no sample to
read and no fit to make here. A replica from before that parameter sends its samples, asked
as columns (``&iterations=columns``): they are handed on as such (``LoadState`` fits them,
taking either form), with no Python object per sample on the way; one from before that
parameter too sends rows, which are handed on as rows.

``phase`` (a fraction of the interval; the poller gives each replica its own,
:func:`serving.state_delta.spread_phase` of its index) is asked of the replica
(``&phase=F``), by every stream alike, so the replicas a guard opens streams to at once do not
all send in the same instant of each interval. A replica from before the parameter ignores
it (an unknown query value) and sends in step with the stream's start, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any
from urllib.parse import urlsplit

from guard.errors import StateUnavailable
from guard.replicas.event_stream import EventStreamProtocol
from guard.replicas.stream_reads import read_round_s, stream_reads
from guard.replicas.stream_view import StreamGroup
from serving.json_body import loads

__all__ = ["UNCHANGED", "StreamGap", "StreamStateSource"]

log = logging.getLogger(__name__)


class _Unchanged:
    """What :meth:`StreamStateSource.take` hands over when events came but changed nothing
    (the poller then only marks the replica's view fresh:
    :meth:`guard.replicas.load_state.LoadState.touch`)."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()


class StreamGap(Exception):
    """An event that does not follow the one before: the document is rebuilt from a new
    stream."""


class StreamStateSource:
    """One replica's state stream, kept open by a task of its own (started on first fetch):
    it connects, waits while the stream lasts, and opens a new one when it ends. Over plain
    ``http://`` the events are parsed and fed as they are read, in the loop's rounds of
    stream reads, by :class:`~guard.replicas.event_stream.EventStreamProtocol`, not by that
    task."""

    kind = "kvguard"

    def __init__(self, url: str, *, client: Any = None, interval_ms: int = 100,
                 timeout_s: float = 1.0, stale_after_s: float | None = None,
                 phase: float | None = None) -> None:
        self.url = url.rstrip("/") + (f"/kvguard/state/stream?interval_ms={interval_ms}"
                                      "&iterations=columns&fit=1")
        if phase is not None:
            if not 0.0 <= phase < 1.0:
                raise ValueError(f"phase must be in [0, 1), got {phase!r}")
            # six decimals, rounded down: below 1 however close the phase is to it
            self.url += f"&phase={math.floor(phase * 1e6) / 1e6:.6f}"
        self.phase = phase  # the one every stream (the first, each resync) asks for
        self._client = client  # an httpx.AsyncClient (None: its own, made on first use)
        self._own_client = client is None
        self._timeout_s = timeout_s
        self._stale_after_s = stale_after_s if stale_after_s is not None else max(
            1.0, 10 * interval_ms / 1000)
        self._read_round_s = read_round_s(interval_ms / 1000)
        self._top: dict | None = None  # the document's other fields (None: no full one yet)
        self._running = StreamGroup(16, advances=True)
        self._waiting = StreamGroup(16, advances=False)
        # the samples the events since the last take brought, and those of the latest event:
        # columns (a dict of lists), or rows (a list of objects) from a replica that sends them
        self._iterations: dict | list = []
        self._latest_iterations: dict | list = []
        self._seq = -1
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._unavailable: str | None = None
        self.fresh = False  # an event arrived since the last take
        self._changed = False  # and one of them changed more than the replica's clock
        self._listener: Any = None  # called with what take() gives, as each event arrives
        self._settled = asyncio.Event()  # set at a full document, a 404 or a failure
        self.num_events = 0
        self.num_resyncs = 0  # new streams after the first
        self.num_gaps = 0  # events whose seq was not the next

    async def fetch(self) -> Any:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
            await asyncio.sleep(0)
        if self._unavailable is not None:
            raise StateUnavailable(self._unavailable)
        if self._top is None:
            if self._error is not None:
                raise self._error
            raise ConnectionError(f"{self.url}: no full document yet")
        return self.take()

    async def opened(self, timeout_s: float) -> str | None:
        """Start the stream and wait for its first full document: None once it came, else why
        it did not (the replica has no stream route, the stream failed, or nothing came within
        ``timeout_s``). :class:`guard.replicas.auto_source.AutoStateSource` asks this."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while True:
            if self._top is not None:
                return None
            if self._unavailable is not None:
                return self._unavailable
            if self._error is not None:
                return f"{type(self._error).__name__}: {self._error}"
            left_s = deadline_s - loop.time()
            if left_s <= 0:
                return f"no full document within {timeout_s:g} s"
            self._settled.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._settled.wait(), left_s)

    @property
    def answers_now(self) -> bool:
        """Whether :meth:`fetch` answers without waiting on anything: the stream is read and
        has its full document (the poller's round then reads it in line, with no task)."""
        task = self._task
        return (task is not None and not task.done() and self._top is not None
                and self._unavailable is None)

    def listen(self, listener: Any) -> None:
        """Hand every event over as it arrives: ``listener(self.take())`` (the poller's
        rounds then find nothing new; freshness is the stream's, not the rounds')."""
        self._listener = listener

    def _arrived(self) -> None:
        listener = self._listener
        if listener is not None:
            payload = self.take()
            if payload is not None:
                listener(payload)

    def take(self) -> dict | None:
        """What the events since the last take brought, as a compact document whose groups
        are :class:`~guard.replicas.stream_view.GroupCapture` (its ``iterations`` only the new
        samples); None when no event arrived since."""
        if not self.fresh or self._top is None:
            return None  # nothing new since the last round: the replica's view stands
        self.fresh = False
        if not self._changed:
            return UNCHANGED  # heard from, nothing changed: the same view, fresh again
        self._changed = False
        iterations, self._iterations = self._iterations, []  # handed on: never changed here
        return {**self._top, "running_columns": self._running.capture(),
                "waiting_columns": self._waiting.capture(), "iterations": iterations}

    def document(self) -> dict | None:
        """The compact document as of the latest event (None before a full one)."""
        if self._top is None:
            return None
        latest = self._latest_iterations
        return {**self._top, "running_columns": self._running.capture().columns(),
                "waiting_columns": self._waiting.capture().columns(),
                "iterations": {name: list(values) for name, values in latest.items()}
                if isinstance(latest, dict) else list(latest)}

    def feed(self, event: dict) -> None:
        """One decoded event (the stream's, as it arrives; tests may call it). StreamGap when
        it does not follow the one before."""
        seq = event.get("seq")
        if "full" in event:
            if seq != 0:
                raise StreamGap(f"a full document with seq {seq!r}")
            full = event["full"]
            block_size = int(full["block_size"])
            for group, name in ((self._running, "running"), (self._waiting, "waiting")):
                group.block_size = block_size
                group.load(full[f"{name}_columns"])
            self._top = {k: v for k, v in full.items()
                         if k not in ("running_columns", "waiting_columns", "iterations")}
            self._iterations = self._latest_iterations = _iterations(full.get("iterations"))
            self._seq = 0
            self._changed = True
            self._settled.set()
        elif "delta" in event:
            if self._top is None or seq != self._seq + 1:
                self.num_gaps += 1
                raise StreamGap(f"seq {seq!r} after {self._seq}")
            delta = event["delta"]
            self._top.update(delta.get("set", ()))
            if "block_size" in delta.get("set", ()):
                raise StreamGap("the block size changed")  # rebuilt from a full document
            self._latest_iterations = latest = _iterations(delta.get("iterations"))
            self._iterations = _joined(self._iterations, latest)
            k = delta.get("advance", 0)
            self._running.apply(delta.get("running", {}), k)
            self._waiting.apply(delta.get("waiting", {}), 0)
            self._seq = seq
            if delta.keys() - {"set"} or delta.get("set", {}).keys() - {"now_s"}:
                self._changed = True
        else:
            raise StreamGap(f"an event of neither kind: {sorted(event)}")
        self.fresh = True
        self.num_events += 1

    async def _run(self) -> None:
        first = True
        while True:
            if not first:
                self.num_resyncs += 1
            first = False
            self._seq, self._top = -1, None  # a new stream starts with a full document
            try:
                await self._read_stream()
            except asyncio.CancelledError:
                raise
            except StreamGap as exc:
                log.info("state stream %s: resync (%s)", self.url, exc)
            except Exception as exc:  # noqa: BLE001 - any failure: a new stream
                self._error = exc
                self._settled.set()
                await asyncio.sleep(min(1.0, self._timeout_s))

    async def _read_stream(self) -> None:
        if self.url.startswith("http://") and self._client is None:
            return await self._read_raw()
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(trust_env=False)
        async with self._client.stream("GET", self.url, timeout=self._timeout_s) as response:
            if response.status_code == 404:
                return await self._no_stream()
            self._unavailable = None
            response.raise_for_status()
            lines = response.aiter_lines().__aiter__()
            while True:
                line = await asyncio.wait_for(lines.__anext__(), self._stale_after_s)
                if line.startswith("data: "):
                    self.feed(loads(line[6:].encode()))
                    self._error = None
                    self._arrived()

    async def _no_stream(self) -> None:
        self._unavailable = f"{self.url} answered 404"
        self._settled.set()
        await asyncio.sleep(30.0)  # asked again now and then

    async def _read_raw(self) -> None:
        """The stream over a plain connection (HTTP/1.1, chunked or until close), read in the
        loop's rounds of stream reads (:mod:`guard.replicas.stream_reads`: at most 5 ms, or 5 %
        of the interval, after its bytes arrived) and parsed by an
        :class:`~guard.replicas.event_stream.EventStreamProtocol`: each event is fed and
        handed over in line as it is read; this task only opens the connection and waits
        until the stream ends (then why it did is raised here: a new stream)."""
        parts = urlsplit(self.url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        request = (f"GET {target} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                   "accept: text/event-stream\r\n\r\n").encode("latin-1")
        protocol = EventStreamProtocol(request, self._opened_stream, self._event,
                                       head_timeout_s=self._timeout_s,
                                       silent_after_s=self._stale_after_s)
        transport, _ = await asyncio.wait_for(stream_reads().create_connection(
            lambda: protocol, parts.hostname or "", parts.port or 80,
            period_s=self._read_round_s), self._timeout_s)
        try:
            why = await protocol.ended
        finally:
            transport.abort()
        if protocol.status == 404:
            return await self._no_stream()
        if isinstance(why, ConnectionError):  # refused, ended or reset: say whose
            raise ConnectionError(f"{self.url}: {why}") from why
        raise why

    def _opened_stream(self) -> None:
        self._unavailable = None  # a 200 head: the replica has a stream (again)

    def _event(self, payloads: list[bytes]) -> None:
        """One event's ``data:`` payloads, as the protocol parses them."""
        for payload in payloads:
            self.feed(loads(payload))
            self._error = None
        self._arrived()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # cancelled again until it ends: asyncio.wait_for (Python 3.11, around the
            # connect and the httpx reader's lines) swallows a cancellation that meets a
            # result just in, and the task would go on
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _iterations(value: Any) -> dict | list:
    """An event's iteration samples as sent: columns (a dict of lists) or rows (a list); none
    is an empty list. StreamGap for anything else (a malformed event); what the lists hold is
    checked where they are read (:class:`guard.replicas.load_state.LoadState`)."""
    if not value:
        return []
    if isinstance(value, (list, dict)):
        return value
    raise StreamGap(f"iterations neither rows nor columns: {type(value).__name__}")


def _joined(before: dict | list, more: dict | list) -> dict | list:
    """The samples of two events of one stream, in order (a new dict or list: the ones handed
    on are never changed). A replica sends one form for a stream's life (a new stream starts
    the samples over), so two forms, or columns with other fields, are a malformed stream:
    StreamGap."""
    if not before:
        return more
    if not more:
        return before
    if isinstance(before, list) and isinstance(more, list):
        return before + more
    if isinstance(before, dict) and isinstance(more, dict) and before.keys() == more.keys():
        return {name: before[name] + more[name] for name in before}
    raise StreamGap("the iteration samples changed form within a stream")
