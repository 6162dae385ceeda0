"""Refreshing every replica's load state: :class:`StatePoller` and the sources it reads.

:class:`HttpStateSource` reads ``GET {url}/kvguard/state`` (or ``{url}/metrics`` for a vLLM,
SGLang, TGI or llama.cpp upstream) over an httpx-shaped client (the proxy passes its pooled
upstream transport); :class:`guard.replicas.auto_source.AutoStateSource` finds out which of
those a replica speaks;
:class:`AsgiStateSource` does an in-process ``GET /kvguard/state`` on the
wrapped ASGI app. A source whose replica answers but publishes no state (404, or a body that is
not a JSON object) raises :class:`StateUnavailable`; the poller then registers the replica as
healthy with unknown capacity (:meth:`guard.replicas.load_state.LoadState.mark_unknown_capacity`) instead
of counting an error, so the guard works in front of any ASGI app. A metrics page that cannot
be read (missing gauges, not Prometheus text) does the same — the replica's capacity is then
learned, it never stays unroutable for it — and its reason is logged as a warning whenever
it changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from guard.background import cancel_and_wait
from guard.config import ReplicaConfig
from guard.errors import StateUnavailable, StateUnparseable
from guard.redact import redact_text
from guard.replicas.engine_metrics import (
    ENGINE_METRICS,
    EngineLoad,
    parse_engine_metrics,
    parse_llamacpp_slots,
)
from guard.replicas.state_stream import UNCHANGED
from serving.json_body import loads
from serving.state_delta import spread_phase

__all__ = [
    "AsgiStateSource",
    "HttpStateSource",
    "StateClient",
    "NoStateSource",
    "StatePoller",
    "StateSink",
    "StateSource",
    "StateUnavailable",
    "METRICS_KINDS",
    "state_sources",
]

log = logging.getLogger(__name__)

# the state sources read from the engine's Prometheus ``/metrics`` page
METRICS_KINDS = ("vllm", *ENGINE_METRICS)


class StateSink(Protocol):
    """What the poller feeds: :class:`guard.replicas.load_state.LoadState` (named here by its
    methods only, so this module does not import the one it feeds)."""

    def update_from_kvguard_state(self, replica_id: str, state: Any, now_s: float) -> Any: ...

    def update_from_vllm_metrics(self, replica_id: str, text: str, now_s: float,
                                 **limits: Any) -> Any: ...

    def update_from_engine_metrics(self, replica_id: str, load: Any, now_s: float,
                                   **limits: Any) -> Any: ...

    def mark_unknown_capacity(self, replica_id: str, now_s: float) -> Any: ...

    def touch(self, replica_id: str, now_s: float) -> Any: ...

    def mark_unhealthy(self, replica_id: str, now_s: float) -> None: ...


class StateClient(Protocol):
    """What :class:`HttpStateSource` needs of an HTTP client: ``httpx.AsyncClient``, or the
    proxy's :class:`guard.proxy.state_client.TransportStateClient` (its pooled transport)."""

    async def get(self, url: str, timeout: float) -> Any:
        """An answer with ``status_code``, ``content``, ``text`` and ``raise_for_status()``."""
        ...


class StateSource(Protocol):
    kind: str  # "kvguard" (JSON dict), a METRICS_KINDS engine (metrics text) or "none"

    async def fetch(self) -> Any:
        """One state document. :class:`StateUnavailable` when the replica has none; any other
        exception counts as a failed refresh."""
        ...


class HttpStateSource:
    """``GET {url}/kvguard/state`` (kind ``kvguard``) or ``GET {url}/metrics`` (a
    ``METRICS_KINDS`` engine).

    A kvguard replica is asked for the compact document (``?compact=1``: sequences as columns)
    with only the iteration samples after the last batch id this source has seen
    (``&since_batch=N``); a replica that ignores the query sends the full document, which
    reads the same. When the replica's ``step_count`` falls (it restarted: batch ids start
    over) the next poll asks for every sample again.
    """

    def __init__(self, url: str, kind: str = "kvguard", *, client: StateClient,
                 timeout_s: float = 1.0, max_model_len: int | None = None):
        if kind != "kvguard" and kind not in METRICS_KINDS:
            raise ValueError(f"HttpStateSource: kind must be 'kvguard' or one of "
                             f"{METRICS_KINDS}, got {kind!r}")
        self.kind = kind
        self.url = url.rstrip("/") + ("/kvguard/state" if kind == "kvguard" else "/metrics")
        self._last_batch_id: int | None = None  # the newest iteration sample seen
        self._last_step_count = -1
        self._client = client
        self._timeout_s = timeout_s
        self.max_model_len = max_model_len  # metrics kinds: their pages lack the context length

    async def fetch(self) -> Any:
        url = self.url
        if self.kind == "kvguard":
            url += "?compact=1"
            if self._last_batch_id is not None:
                url += f"&since_batch={self._last_batch_id}"
        response = await self._client.get(url, timeout=self._timeout_s)
        if self.kind == "kvguard" and response.status_code == 404:
            raise StateUnavailable(f"{self.url} answered 404")
        if self.kind == "llamacpp" and response.status_code in (404, 501):
            return await self._slots()  # llama-server without --metrics: its /slots
        response.raise_for_status()
        if self.kind != "kvguard":
            return response.text
        state = _state_document(response.content, self.url)
        self._note_batches(state)
        return state

    def _note_batches(self, state: dict) -> None:
        step_count = state.get("step_count")
        if isinstance(step_count, int) and step_count < self._last_step_count:
            self._last_batch_id = None  # restarted: its batch ids start over
        self._last_step_count = step_count if isinstance(step_count, int) else -1
        for it in state.get("iterations") or ():
            batch_id = it.get("batch_id") if isinstance(it, dict) else None
            if isinstance(batch_id, int) and (self._last_batch_id is None
                                              or batch_id > self._last_batch_id):
                self._last_batch_id = batch_id


    async def _slots(self) -> EngineLoad:
        url = self.url.removesuffix("/metrics") + "/slots"
        response = await self._client.get(url, timeout=self._timeout_s)
        if response.status_code != 200:
            raise StateUnavailable(f"{self.url} and {url} answered {response.status_code}")
        try:
            return parse_llamacpp_slots(response.text)
        except ValueError as exc:
            raise StateUnparseable(f"{url}: {exc}") from None


class NoStateSource:
    """A replica configured with ``state_source = "none"``: never asked, unknown capacity."""

    kind = "kvguard"
    local = True  # answers without I/O: polled without a timeout task (see StatePoller)

    async def fetch(self) -> Any:
        raise StateUnavailable("state_source is 'none'")


class AsgiStateSource:
    """Reads ``/kvguard/state`` from an ASGI app in-process: a synthetic GET, no network."""

    kind = "kvguard"

    def __init__(self, app: Callable, path: str = "/kvguard/state"):
        self._app = app
        self._path = path

    async def fetch(self) -> Any:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": self._path, "raw_path": self._path.encode(),
            "root_path": "", "query_string": b"", "headers": [(b"host", b"kvguard.internal")],
            "client": ("127.0.0.1", 0), "server": ("kvguard.internal", 80),
        }
        status: list[int] = []
        chunks: list[bytes] = []
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # never: the app should not read past the body
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._app(scope, receive, send)
        if status[:1] == [404]:
            raise StateUnavailable(f"in-process {self._path} answered 404")
        if not status or status[0] != 200:
            raise RuntimeError(f"in-process {self._path} answered {status[:1] or 'nothing'}")
        return _state_document(b"".join(chunks), f"in-process {self._path}")


def _state_document(body: bytes, where: str) -> dict:
    """A ``/kvguard/state`` body as a dict; StateUnavailable when it is not a JSON object."""
    try:  # orjson where it parses as the stdlib would: polls share the requests' loop
        state = loads(body)
    except (ValueError, UnicodeDecodeError):
        raise StateUnavailable(f"{where} is not JSON") from None
    if not isinstance(state, dict):
        raise StateUnavailable(f"{where} is not a JSON object")
    return state


def state_sources(replicas: tuple[ReplicaConfig, ...], client: StateClient,
                  app: Callable | None = None, timeout_s: float = 1.0,
                  local_replica_id: str = "local",
                  stream_interval_s: float = 0.1,
                  first_index: int = 0) -> dict[str, StateSource]:
    """One source per configured replica; no replicas means ``app`` itself is the one replica.
    ``stream_interval_s``: how often a ``stream`` replica sends an event (the refresh
    interval). The ``stream`` (and ``auto``) replicas' streams ask each for its own phase of
    that interval (the ``index``-th replica's: ``serving.state_delta.spread_phase(index)``;
    ``first_index`` is the first of ``replicas``' index among those the guard follows: a
    replica that joins later gets the next), so the streams the guard opens at its start do
    not all send at the same instant."""
    if not replicas:
        if app is None:
            raise ValueError("state_sources: in-process mode needs the wrapped ASGI app")
        return {local_replica_id: AsgiStateSource(app)}
    sources: dict[str, StateSource] = {}
    for index, replica in enumerate(replicas, first_index):
        if replica.state_source == "none":
            sources[replica.replica_id] = NoStateSource()
        elif replica.state_source == "auto":
            from guard.replicas.auto_source import AutoStateSource

            sources[replica.replica_id] = AutoStateSource(
                replica.url, client=client, timeout_s=timeout_s,
                max_model_len=replica.max_model_len, replica_id=replica.replica_id,
                stream_interval_ms=max(10, min(5000, round(stream_interval_s * 1000))),
                stream_phase=spread_phase(index))
        elif replica.state_source == "stream":
            from guard.replicas.state_stream import StreamStateSource

            sources[replica.replica_id] = StreamStateSource(
                replica.url, timeout_s=timeout_s,
                interval_ms=max(10, min(5000, round(stream_interval_s * 1000))),
                phase=spread_phase(index))
        elif replica.state_source == "asgi":
            if app is None:
                raise ValueError(f"replica {replica.replica_id!r}: state_source 'asgi' needs the app")
            sources[replica.replica_id] = AsgiStateSource(app)
        else:
            sources[replica.replica_id] = HttpStateSource(
                replica.url, replica.state_source, client=client, timeout_s=timeout_s,
                max_model_len=replica.max_model_len)
    return sources


class StatePoller:
    """Refreshes every replica's state each ``interval_s``; never lets an exception escape.

    After ``unhealthy_after_errors`` consecutive failures a replica is marked unhealthy; one good
    refresh makes it healthy again. ``on_refresh`` (optional, sync) runs after every round — the
    admission queue re-evaluates there.

    ``unreadable`` maps each replica whose last refresh failed to why (an unreachable replica,
    a timeout) or whose page could not be understood (a vLLM ``/metrics`` without
    ``num_gpu_blocks``: still routed, with unknown capacity); a warning names the replica and
    the reason when it becomes unreadable and an info line when it is read again, once per
    transition. A failure whose exception has a true ``quiet`` attribute (an ejected replica,
    whose ejection was logged already) is recorded without a line.

    A source that pushes (a stream: ``listen``) hands each update over as it arrives; a round
    skips it while it is live (``answers_now``: nothing new would be found, its events came
    already) and fetches it otherwise, which (re)starts it: a round costs what it can find,
    not a fetch per streamed replica (0.21 → 0.065 ms a round at 256 live streams).

    Pushed updates are applied in batches: the first to arrive opens one, applied at the
    loop's next turn with every update that came meanwhile, in arrival order, each as of its
    arrival (its replica's view is stamped then); a round applies the open batch first. The
    streams are read in rounds (:mod:`guard.replicas.stream_reads`, every 5 ms): a batch is
    a round's updates, ~13 at 256 replicas streaming at 10 Hz, and the load state's Python
    runs back to back instead of between two socket reads each.
    """

    def __init__(self, load_state: StateSink, sources: Mapping[str, StateSource],
                 interval_s: float, *, clock: Callable[[], float] = time.monotonic,
                 unhealthy_after_errors: int = 3, timeout_s: float = 2.0,
                 on_refresh: Callable[[], None] | None = None):
        if interval_s <= 0 or unhealthy_after_errors < 1:
            raise ValueError("StatePoller: interval_s must be > 0, unhealthy_after_errors >= 1")
        self._load_state = load_state
        self._sources = dict(sources)
        self._interval_s = interval_s
        self._clock = clock
        self._unhealthy_after = unhealthy_after_errors
        self._timeout_s = timeout_s
        self._on_refresh = on_refresh
        self._errors = dict.fromkeys(self._sources, 0)
        self._unavailable: dict[str, str] = {}  # the last reason logged per replica
        # sources that answer without I/O (``local``: state_source "none") are read in line,
        # with no task and no timeout; the others concurrently, each under ``timeout_s``
        self._local = {rid: src for rid, src in self._sources.items()
                       if getattr(src, "local", False)}
        self._remote = {rid: src for rid, src in self._sources.items() if rid not in self._local}
        self._pushed_ids: set[str] = set()  # the replicas whose sources push (streams)
        for rid, src in self._sources.items():
            self._listen(rid, src)
        self._task: asyncio.Task | None = None
        # pushed updates not applied yet: (replica id, source, payload, arrival time), and
        # the loop's call that applies them
        self._pushes: list[tuple[str, StateSource, Any, float]] = []
        self._push_call: asyncio.Handle | None = None
        self.num_push_batches = 0
        self.num_refreshes = 0
        self.unreadable: dict[str, str] = {}  # replica id -> why its last refresh failed

    def consecutive_errors(self, replica_id: str) -> int:
        return self._errors[replica_id]

    def add(self, replica_id: str, source: StateSource) -> None:
        """A replica joined: polled from the next round on."""
        self._sources[replica_id] = source
        self._errors[replica_id] = 0
        (self._local if getattr(source, "local", False) else self._remote)[replica_id] = source
        self._listen(replica_id, source)

    def _listen(self, replica_id: str, source: StateSource) -> None:
        """A source that pushes (a stream) hands each update over as it arrives."""
        if getattr(source, "pushes", hasattr(source, "listen")):
            source.listen(lambda payload: self._push(replica_id, source, payload))
            self._pushed_ids.add(replica_id)
        else:
            self._pushed_ids.discard(replica_id)

    def _push(self, replica_id: str, source: StateSource, payload: Any) -> None:
        """A pushed update, into the open batch (the class docstring)."""
        self._pushes.append((replica_id, source, payload, self._clock()))
        if self._push_call is None:
            self._push_call = asyncio.get_running_loop().call_soon(self.apply_pushed)

    def apply_pushed(self) -> None:
        """Apply the pushed updates not applied yet, in the order they came."""
        if self._push_call is not None:
            self._push_call.cancel()
            self._push_call = None
        pushes, self._pushes = self._pushes, []
        if pushes:
            self.num_push_batches += 1
        for replica_id, source, payload, arrived_s in pushes:
            self._pushed(replica_id, source, payload, arrived_s)

    def _pushed(self, replica_id: str, source: StateSource, payload: Any,
                arrived_s: float) -> None:
        if self._sources.get(replica_id) is not source:
            return  # it left the fleet
        try:
            if payload is UNCHANGED:
                self._load_state.touch(replica_id, arrived_s)
            else:
                self._apply(replica_id, source, payload, arrived_s)
        except Exception as exc:  # the stream reader outlives a bad update
            self._errors[replica_id] += 1
            self._unreadable(replica_id, exc)
            return
        self._errors[replica_id] = 0
        self._unavailable.pop(replica_id, None)
        self._readable(replica_id)

    def remove(self, replica_id: str) -> None:
        """A replica left: not polled any more (a fetch in flight is not applied)."""
        source = self._sources.get(replica_id)
        for table in (self._sources, self._local, self._remote, self._errors,
                      self._unavailable, self.unreadable):
            table.pop(replica_id, None)
        self._pushed_ids.discard(replica_id)
        _close_soon(source)

    async def refresh_now(self) -> None:
        """Refresh all replicas once, concurrently (the pushed updates not applied yet
        first)."""
        self.apply_pushed()
        for rid, src in self._local.items():
            await self._refresh_one(rid, src, bounded=False)
        remote = []
        pushed = self._pushed_ids
        for rid, src in list(self._remote.items()):
            # a live stream's fetch waits on nothing (its events came as they arrived): one
            # that pushes them is skipped, one that does not is read in line, without the task
            # and timer per replica per round of the others
            if getattr(src, "answers_now", False):
                if rid not in pushed:
                    await self._refresh_one(rid, src, bounded=False)
            else:
                remote.append((rid, src))
        if remote:  # gathered even when one: a cancellation that meets a fetch just
            # done is then still raised (asyncio.wait_for alone would swallow it, Python 3.11)
            await asyncio.gather(*(self._refresh_one(rid, src) for rid, src in remote))
        self.num_refreshes += 1
        if self._on_refresh is not None:
            try:
                self._on_refresh()
            except Exception:
                log.exception("state poller: on_refresh callback failed")

    async def _refresh_one(self, replica_id: str, source: StateSource,
                           bounded: bool = True) -> None:
        try:
            fetch = source.fetch()
            payload = await (asyncio.wait_for(fetch, self._timeout_s) if bounded else fetch)
            if self._sources.get(replica_id) is not source:
                return  # it left the fleet while its state was on the way
            if payload is UNCHANGED:  # a stream: heard from, nothing changed
                self._load_state.touch(replica_id, self._clock())
            elif payload is not None:  # None: a stream with nothing new since the last round
                self._apply(replica_id, source, payload, self._clock())
            self._errors[replica_id] = 0
            self._unavailable.pop(replica_id, None)
            self._readable(replica_id)
        except asyncio.CancelledError:
            raise
        except StateUnavailable as exc:
            if self._sources.get(replica_id) is not source:
                return
            self._errors[replica_id] = 0
            if isinstance(exc, StateUnparseable):  # read, not understood: shown, still routed
                self.unreadable[replica_id] = redact_text(str(exc))
            else:  # it publishes no state: nothing to read
                self._readable(replica_id)
            self._log_unavailable(replica_id, exc)
            self._load_state.mark_unknown_capacity(replica_id, self._clock())
        except Exception as exc:
            if self._sources.get(replica_id) is not source:
                return
            self._errors[replica_id] += 1
            self._unreadable(replica_id, exc)
            if self._errors[replica_id] >= self._unhealthy_after:
                self._load_state.mark_unhealthy(replica_id, self._clock())

    def _readable(self, replica_id: str) -> None:
        if self.unreadable.pop(replica_id, None) is not None:
            log.info("replica %s: state read again", replica_id)

    def _unreadable(self, replica_id: str, exc: Exception) -> None:
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            reason = f"no answer within {self._timeout_s:g} s"
        else:
            reason = f"{type(exc).__name__}: {redact_text(str(exc)) or 'no detail'}"
        first = replica_id not in self.unreadable
        self.unreadable[replica_id] = reason
        if first and not getattr(exc, "quiet", False):
            log.warning("replica %s: state unreadable: %s", replica_id, reason)

    def _apply(self, replica_id: str, source: StateSource, payload: Any, now_s: float) -> None:
        """Feed one fetched document to the load state; a metrics page that cannot be read
        raises :class:`StateUnparseable`."""
        kind = source.kind
        if kind == "kvguard":
            self._load_state.update_from_kvguard_state(replica_id, payload, now_s)
            return
        max_model_len = getattr(source, "max_model_len", None)
        try:
            if kind == "vllm":
                self._load_state.update_from_vllm_metrics(replica_id, payload, now_s,
                                                          max_model_len=max_model_len)
            else:
                load = payload if isinstance(payload, EngineLoad) \
                    else parse_engine_metrics(kind, payload)
                self._load_state.update_from_engine_metrics(replica_id, load, now_s,
                                                            max_model_len=max_model_len)
        except ValueError as exc:
            raise StateUnparseable(f"{getattr(source, 'url', kind)}: {exc}") from None

    def _log_unavailable(self, replica_id: str, exc: StateUnavailable) -> None:
        """An unreadable page is a warning, a replica without state a note; each once per
        reason (it repeats on every poll)."""
        reason = str(exc)
        if self._unavailable.get(replica_id) == reason:
            return
        self._unavailable[replica_id] = reason
        level = logging.WARNING if isinstance(exc, StateUnparseable) else logging.INFO
        log.log(level, "replica %s: no load state read (%s); its concurrency limit is learned "
                "from its responses", replica_id, reason)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            started_s = time.monotonic()
            try:
                await self.refresh_now()
            except Exception:  # refresh_now catches per replica; this is the last line
                log.exception("state poller: refresh round failed")
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started_s)))

    async def stop(self) -> None:
        """Cancel the polling task and wait for it to end; close the sources that hold a
        connection of their own (streams)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.apply_pushed()  # what came before the stop, not left to the loop
        for source in self._sources.values():
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()


def _close_soon(source: Any) -> None:
    """Close a removed source's own connection (a stream) without waiting for it."""
    close = getattr(source, "aclose", None)
    if close is not None:
        with contextlib.suppress(RuntimeError):  # no running loop: nothing was opened
            asyncio.get_running_loop().create_task(close())
