"""Per-replica load state, the guard's in-flight reservations, and the snapshot policies read.

:class:`LoadState` turns each replica's ``/kvguard/state`` JSON (or, for black-box vLLM
upstreams, its Prometheus ``/metrics`` text) into an immutable
:class:`policies.snapshot.ReplicaSnapshot`, feeds the replica's iteration records to its
:class:`guard.latency_model.StepTimeFitter`, and adds the requests this guard admitted that the
replica has not reported yet (reservations). ``snapshot(now_s)`` is the whole
:class:`~policies.snapshot.LoadSnapshot`.

Reservations end early when the replica's state lists the request id (the guard forwards its id as
``x-request-id``); for ``vllm`` replicas, whose metrics carry no ids, a reservation ends once a
scrape that started after it was made has been applied (the request is counted there).

:class:`StatePoller` refreshes every replica each ``interval_s`` from its source:
:class:`HttpStateSource` (``GET {url}/kvguard/state`` or ``{url}/metrics`` over httpx) or
:class:`AsgiStateSource` (an in-process ``GET /kvguard/state`` on the wrapped ASGI app).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from guard.config import ReplicaConfig
from guard.latency_model import StepTimeFitter, prior_from_timing_model, roofline_prior
from policies.cost import RequestCost
from policies.snapshot import LoadSnapshot, ReplicaSnapshot, SeqLoad
from policies.step_time import StepTimeModel

__all__ = [
    "AsgiStateSource",
    "HttpStateSource",
    "LoadState",
    "StatePoller",
    "UNKNOWN_MAX_MODEL_LEN",
    "StateSource",
    "parse_vllm_metrics",
    "state_sources",
]

log = logging.getLogger(__name__)

# ReplicaSnapshot.max_model_len for a black-box replica whose context length nobody configured
UNKNOWN_MAX_MODEL_LEN = 1 << 30


@dataclass
class _Reservation:
    replica_id: str
    cost: RequestCost
    reserved_s: float
    load: SeqLoad  # built once at reserve time
    reported: bool = False  # the replica listed it: its blocks are in the replica's own counts


@dataclass
class _Replica:
    fitter: StepTimeFitter
    model: StepTimeModel  # the fitter's model after the last update (refits happen off the hot path)
    base: ReplicaSnapshot | None = None  # the replica's own state, without reservations
    last_batch_id: int = -1
    last_step_count: int = -1
    previous_observed_s: float = float("-inf")
    combined: ReplicaSnapshot | None = None  # base + reservations, rebuilt when dirty


def _default_fitter(prior: StepTimeModel) -> StepTimeFitter:
    return StepTimeFitter(prior)


class LoadState:
    """Mutable load state of all replicas; every read returns immutable snapshots.

    Not thread-safe: use it from one event loop. The snapshot's ``step_time`` is the
    coefficient-wise mean of the fitted models of the healthy replicas (the default prior when none
    is healthy); :meth:`step_time_model` gives one replica's.
    """

    def __init__(self, max_staleness_s: float = 2.0,
                 fitter_factory: Callable[[StepTimeModel], StepTimeFitter] = _default_fitter,
                 default_prior: StepTimeModel | None = None):
        if max_staleness_s <= 0:
            raise ValueError("max_staleness_s: must be > 0")
        self._max_staleness_s = max_staleness_s
        self._fitter_factory = fitter_factory
        self._default_prior = default_prior or roofline_prior()
        self._replicas: dict[str, _Replica] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._step_time: StepTimeModel | None = None  # the mean model, reset on every update

    # --- replica state -----------------------------------------------------------------------

    def _replica(self, replica_id: str, prior: StepTimeModel | None = None) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            fitter = self._fitter_factory(prior or self._default_prior)
            replica = _Replica(fitter, fitter.model())
            self._replicas[replica_id] = replica
        return replica

    def update_from_kvguard_state(self, replica_id: str, state: Mapping[str, Any],
                                  now_s: float) -> ReplicaSnapshot:
        """Apply one ``/kvguard/state`` document received at ``now_s`` (guard clock)."""
        prior = prior_from_timing_model(state.get("timing_model"), state.get("time_scale", 1.0))
        replica = self._replica(replica_id, prior)
        listed = {s["request_id"] for s in (*state["running"], *state["waiting"])}
        base = ReplicaSnapshot(
            replica_id=replica_id,
            observed_s=now_s,
            block_size=int(state["block_size"]),
            num_total_blocks=int(state["num_total_blocks"]),
            num_free_blocks=int(state["num_free_blocks"]),
            max_num_seqs=int(state["max_num_seqs"]),
            max_num_batched_tokens=int(state["max_num_batched_tokens"]),
            max_model_len=int(state["max_model_len"]),
            running=tuple(self._seq_load(s) for s in state["running"]),
            waiting=tuple(self._seq_load(s) for s in state["waiting"]),
        )
        self._feed_iterations(replica, state)
        for reservation in self._reservations.values():
            if reservation.replica_id == replica_id and reservation.cost.request_id in listed:
                reservation.reported = True
        return self._set_base(replica, base)

    def _seq_load(self, seq: Mapping[str, Any]) -> SeqLoad:
        reservation = self._reservations.get(seq["request_id"])
        num_output = int(seq["num_output_tokens"])
        max_tokens = seq.get("max_tokens")
        remaining_max = max(0, int(max_tokens) - num_output) if max_tokens is not None else None
        itl_s = None
        if reservation is not None:  # ours: we know its class and expected length
            expected = max(1, reservation.cost.num_expected_output_tokens - num_output)
            remaining = expected if remaining_max is None else min(remaining_max, expected)
            itl_s = reservation.cost.request_class.itl_s
        else:
            remaining = remaining_max if remaining_max is not None else 1
        return SeqLoad(
            num_context_tokens=int(seq["num_context_tokens"]),
            num_prefill_tokens_remaining=int(seq["num_prefill_tokens_remaining"]),
            num_remaining_output_tokens=remaining,
            itl_s=itl_s,
        )

    def _feed_iterations(self, replica: _Replica, state: Mapping[str, Any]) -> None:
        step_count = int(state.get("step_count", -1))
        if 0 <= step_count < replica.last_step_count:  # the engine restarted: ids start over
            replica.last_batch_id = -1
            replica.fitter.forget_batch_ids()
        replica.last_step_count = step_count
        for it in state.get("iterations") or ():
            batch_id = int(it["batch_id"])
            if batch_id <= replica.last_batch_id:
                continue
            replica.last_batch_id = batch_id
            replica.fitter.add(int(it["num_prefill_tokens"]), int(it["num_decode_seqs"]),
                               int(it["num_context_tokens"]), float(it["duration_s"]), batch_id)
        replica.model = replica.fitter.model()

    def update_from_vllm_metrics(self, replica_id: str, text: str, now_s: float, *,
                                 max_model_len: int | None = None, max_num_seqs: int = 256,
                                 max_num_batched_tokens: int = 8192,
                                 assumed_output_tokens: int = 128,
                                 assumed_prompt_tokens: int = 512) -> ReplicaSnapshot:
        """Apply one vLLM ``/metrics`` scrape (black-box upstream: counts, no request ids).

        Running requests share the used KV evenly; unknown lengths use the ``assumed_*`` values.
        Limits missing from the metrics' ``*_info`` labels come from the keyword arguments; an
        unknown ``max_model_len`` becomes ``UNKNOWN_MAX_MODEL_LEN`` (no guard-side context check:
        the upstream answers an overflow itself).
        """
        m = parse_vllm_metrics(text)
        block_size = int(m.get("block_size", 16))
        total = int(m["num_gpu_blocks"])
        free = int(round(total * (1.0 - m["kv_cache_usage_ratio"])))
        running = int(m["num_requests_running"])
        context = (total - free) * block_size // running if running else 0
        replica = self._replica(replica_id)
        base = ReplicaSnapshot(
            replica_id=replica_id,
            observed_s=now_s,
            block_size=block_size,
            num_total_blocks=total,
            num_free_blocks=free,
            max_num_seqs=int(m.get("max_num_seqs", max_num_seqs)),
            max_num_batched_tokens=int(m.get("max_num_batched_tokens", max_num_batched_tokens)),
            max_model_len=int(m.get("max_model_len", max_model_len or UNKNOWN_MAX_MODEL_LEN)),
            running=(SeqLoad(context, 0, assumed_output_tokens),) * running,
            waiting=(SeqLoad(0, assumed_prompt_tokens, assumed_output_tokens),)
            * int(m["num_requests_waiting"]),
        )
        for reservation in self._reservations.values():
            if reservation.replica_id == replica_id and reservation.reserved_s <= replica.previous_observed_s:
                reservation.reported = True
        replica.previous_observed_s = now_s
        return self._set_base(replica, base)

    def _set_base(self, replica: _Replica, base: ReplicaSnapshot) -> ReplicaSnapshot:
        replica.base = base
        replica.combined = None
        self._step_time = None
        return base

    def mark_unhealthy(self, replica_id: str, now_s: float) -> None:
        """The replica stopped answering: policies no longer pick it until a good state arrives."""
        replica = self._replica(replica_id)
        if replica.base is not None and replica.base.healthy:
            self._set_base(replica, dataclasses.replace(replica.base, healthy=False))

    def is_healthy(self, replica_id: str) -> bool:
        replica = self._replicas.get(replica_id)
        return bool(replica and replica.base and replica.base.healthy)

    # --- reservations -----------------------------------------------------------------------

    def reserve(self, replica_id: str, request_id: str, cost: RequestCost,
                now_s: float | None = None) -> None:
        """The guard admitted ``cost`` to ``replica_id`` at ``now_s`` (default: its arrival).

        Counted in the replica's snapshot until the replica reports it or it is released.
        """
        reserved_s = cost.arrival_s if now_s is None else now_s
        self._reservations[request_id] = _Reservation(replica_id, cost, reserved_s,
                                                      _reserved_load(cost))
        self._dirty(replica_id)

    def release(self, request_id: str) -> bool:
        """The request ended (ticket released). False if it held no reservation."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        self._dirty(reservation.replica_id)
        return True

    def _dirty(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.combined = None

    def _pending(self, replica_id: str) -> list[_Reservation]:
        return [r for r in self._reservations.values()
                if r.replica_id == replica_id and not r.reported]

    def num_reserved_blocks(self, replica_id: str) -> int:
        return sum(r.cost.num_blocks for r in self._pending(replica_id))

    def num_inflight(self, replica_id: str) -> int:
        return sum(1 for r in self._reservations.values() if r.replica_id == replica_id)

    # --- snapshots ----------------------------------------------------------------------------

    def replica_snapshot(self, replica_id: str) -> ReplicaSnapshot | None:
        """The replica's state plus pending reservations; None before its first state."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.base is None:
            return None
        if replica.combined is None:
            pending = self._pending(replica_id)
            replica.combined = replica.base.with_reservations(  # keeps the engine groups' sums
                tuple(r.load for r in pending),
                sum(r.cost.num_blocks for r in pending),
                self.num_inflight(replica_id),
            )
        return replica.combined

    def snapshot(self, now_s: float, num_queued: int = 0, drain_rate_rps: float = 0.0,
                 tenant_retry_ratio: Mapping[str, float] | None = None) -> LoadSnapshot:
        replicas = tuple(s for rid in self._replicas if (s := self.replica_snapshot(rid)))
        return LoadSnapshot(
            now_s=now_s,
            replicas=replicas,
            step_time=self._mean_model(replicas) if self._step_time is None else self._step_time,
            num_queued=num_queued,
            max_staleness_s=self._max_staleness_s,
            drain_rate_rps=drain_rate_rps,
            tenant_retry_ratio=dict(tenant_retry_ratio or {}),
        )

    def step_time_model(self, replica_id: str) -> StepTimeModel:
        replica = self._replicas.get(replica_id)
        return replica.model if replica else self._default_prior

    def fitter(self, replica_id: str) -> StepTimeFitter | None:
        """The replica's fitter (for exporting its prediction error), None if unknown."""
        replica = self._replicas.get(replica_id)
        return replica.fitter if replica else None

    def _mean_model(self, replicas: tuple[ReplicaSnapshot, ...]) -> StepTimeModel:
        models = [self._replicas[s.replica_id].model for s in replicas if s.healthy]
        if not models:
            self._step_time = self._default_prior
        else:
            columns = zip(*(m.as_tuple() for m in models), strict=True)
            self._step_time = StepTimeModel(*(sum(c) / len(models) for c in columns))
        return self._step_time


def _reserved_load(cost: RequestCost) -> SeqLoad:
    return SeqLoad(
        num_context_tokens=0,
        num_prefill_tokens_remaining=cost.num_prompt_tokens,
        num_remaining_output_tokens=cost.num_expected_output_tokens,
        itl_s=cost.request_class.itl_s,
    )


_VLLM_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_ratio",  # the name before vLLM v0.10
}
_INFO_LABELS = ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens")


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The load figures in a vLLM ``/metrics`` text; ValueError when a required one is missing.

    Request counts are summed over label sets (several engines); KV usage (a 0–1 fraction despite
    the ``_perc`` name) is averaged. ``block_size`` and friends come from ``*_info`` labels.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, list[float]] = {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _VLLM_GAUGES.get(sample.name)
            if key is not None:
                sums.setdefault(key, []).append(float(sample.value))
            elif sample.name.endswith("_info"):
                for label in _INFO_LABELS:
                    if label in sample.labels and sample.labels[label] not in ("", "None"):
                        out[label] = float(sample.labels[label])
    for key, values in sums.items():
        out[key] = sum(values) / len(values) if key == "kv_cache_usage_ratio" else sum(values)
    missing = [k for k in ("num_requests_running", "num_requests_waiting",
                           "kv_cache_usage_ratio", "num_gpu_blocks") if k not in out]
    if missing:
        raise ValueError(f"vLLM metrics lack {', '.join(missing)}")
    return out


class StateSource(Protocol):
    kind: str  # "kvguard" (JSON dict) or "vllm" (metrics text)

    async def fetch(self) -> Any:
        """One state document; any exception counts as a failed refresh."""
        ...


class HttpStateSource:
    """``GET {url}/kvguard/state`` (kind ``kvguard``) or ``GET {url}/metrics`` (kind ``vllm``)."""

    def __init__(self, url: str, kind: str = "kvguard", *, client: httpx.AsyncClient,
                 timeout_s: float = 1.0, max_model_len: int | None = None):
        if kind not in ("kvguard", "vllm"):
            raise ValueError(f"HttpStateSource: kind must be 'kvguard' or 'vllm', got {kind!r}")
        self.kind = kind
        self.url = url.rstrip("/") + ("/kvguard/state" if kind == "kvguard" else "/metrics")
        self._client = client
        self._timeout_s = timeout_s
        self.max_model_len = max_model_len  # vllm only: its metrics lack the context length

    async def fetch(self) -> Any:
        response = await self._client.get(self.url, timeout=self._timeout_s)
        response.raise_for_status()
        return response.json() if self.kind == "kvguard" else response.text


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
        if not status or status[0] != 200:
            raise RuntimeError(f"in-process {self._path} answered {status[:1] or 'nothing'}")
        return json.loads(b"".join(chunks))


def state_sources(replicas: tuple[ReplicaConfig, ...], client: httpx.AsyncClient,
                  app: Callable | None = None, timeout_s: float = 1.0,
                  local_replica_id: str = "local") -> dict[str, StateSource]:
    """One source per configured replica; no replicas means ``app`` itself is the one replica."""
    if not replicas:
        if app is None:
            raise ValueError("state_sources: in-process mode needs the wrapped ASGI app")
        return {local_replica_id: AsgiStateSource(app)}
    sources: dict[str, StateSource] = {}
    for replica in replicas:
        if replica.state_source == "asgi":
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
    """

    def __init__(self, load_state: LoadState, sources: Mapping[str, StateSource],
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
        self._task: asyncio.Task | None = None
        self.num_refreshes = 0

    def consecutive_errors(self, replica_id: str) -> int:
        return self._errors[replica_id]

    async def refresh_now(self) -> None:
        """Refresh all replicas once, concurrently."""
        await asyncio.gather(*(self._refresh_one(rid, src) for rid, src in self._sources.items()))
        self.num_refreshes += 1
        if self._on_refresh is not None:
            try:
                self._on_refresh()
            except Exception:
                log.exception("state poller: on_refresh callback failed")

    async def _refresh_one(self, replica_id: str, source: StateSource) -> None:
        try:
            payload = await asyncio.wait_for(source.fetch(), self._timeout_s)
            now_s = self._clock()
            if source.kind == "kvguard":
                self._load_state.update_from_kvguard_state(replica_id, payload, now_s)
            else:
                self._load_state.update_from_vllm_metrics(
                    replica_id, payload, now_s, max_model_len=getattr(source, "max_model_len", None))
            self._errors[replica_id] = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._errors[replica_id] += 1
            log.debug("state poller: %s refresh failed: %r", replica_id, exc)
            if self._errors[replica_id] >= self._unhealthy_after:
                self._load_state.mark_unhealthy(replica_id, self._clock())

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
        """Cancel the polling task and wait for it to end."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
