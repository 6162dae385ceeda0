"""The open-loop runner: fire every planned request at its scheduled time, whatever happens.

Requests are launched by one dispatcher coroutine that sleeps until each arrival and starts a
task for it; it never waits for a response. After the schedule ends, in-flight requests get
``drain_timeout_s`` to finish, then the stragglers are canceled (recorded as ``canceled``).

The runner also proves it was not the bottleneck: it reports the achieved send rate against
the schedule's (``sustained_rate_of``), the send lag, and its own CPU use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import resource
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from chaos.client import CompletionClient, make_http_client, request_body, require_loopback
from chaos.raw_client import RawCompletionClient, RawConnectionPool
from chaos.records import OUTCOMES, RequestRecord, RequestSpec
from chaos.schedule import prompt_token_ids
from chaos.stats import distribution
from guard.observe.loop_lag import LoopLag

__all__ = ["LoadConfig", "LoadResult", "LiveCounts", "run_load", "rate_of", "sustained_rate_of",
           "few_collections", "GcPauses", "loop_lag", "run_queue_wait_s"]

CLIENTS = ("aiohttp", "raw")
MAX_RATE_SHORTFALL_RATIO = 0.02
MAX_CPU_PERCENT = 85.0
MAX_CPU_WAIT_RATIO = 0.10
MAX_GC_PAUSE_S = 0.1
MAX_LOOP_LAG_S = 0.1  # the generator's loop late by more: every stream it measures shows it
_NO_FULL_COLLECTION = 1_000_000_000  # young collections before a full one: never, in a run


@dataclass(frozen=True)
class LoadConfig:
    url: str
    duration_s: float
    seed: int = 0
    model: str | None = None
    timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    max_connections: int = 4096
    class_header: str = "x-kvguard-class"
    client: str = "aiohttp"  # or "raw": chaos.raw_client, a cheaper sender for floods

    def __post_init__(self) -> None:
        require_loopback(self.url)
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.duration_s <= 0 or self.timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("duration_s and timeout_s must be > 0, drain_timeout_s >= 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")


class LiveCounts:
    """Running tallies for the progress display (mutated only on the event loop)."""

    def __init__(self, num_planned: int) -> None:
        self.num_planned = num_planned
        self.num_sent = 0
        self.by_outcome = dict.fromkeys(OUTCOMES, 0)

    @property
    def num_in_flight(self) -> int:
        return self.num_sent - sum(self.by_outcome.values())


def rate_of(times_s: list[float]) -> float | None:
    """Events per second over the span of ``times_s`` ((n - 1) / span); None under 2 events."""
    if len(times_s) < 2:
        return None
    span_s = max(times_s) - min(times_s)
    return (len(times_s) - 1) / span_s if span_s > 0 else None


def sustained_rate_of(records: Sequence[RequestRecord]) -> float | None:
    """The rate the generator kept over the arrivals it sent: the schedule's rate over them ÷
    the least-squares slope of send time against scheduled time (None under 2 sends). A
    constant lag leaves it at the schedule's rate and a generator falling steadily behind
    lowers it, while one late send moves it little. (The span rate of the send times moves by
    that one send's whole lag: one arrival 0.75 s late at the end of a 22 s run reads 3.3 %
    short; the lag percentiles judge single late sends.)"""
    pairs = [(r.scheduled_s, r.sent_s) for r in records if r.sent_s is not None]
    planned = rate_of([x for x, _ in pairs])
    if planned is None:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    var = sum((x - mean_x) ** 2 for x, _ in pairs)
    return planned * var / cov if cov > 0 else None


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float          # declared schedule length
    wall_s: float              # from start to the last request finishing or being canceled
    cpu_s: float               # this process's user + system CPU over the run
    scheduled_rate_per_s: float | None
    achieved_rate_per_s: float | None
    cpu_wait_s: float | None = None  # runnable but kept off a CPU by the OS (Linux only)
    gc_pause_max_s: float | None = None  # the longest cyclic-GC pause of this process
    loop_lag_max_s: float | None = None  # this process's event loop at its latest (loop_lag)

    @property
    def cpu_percent(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rate_shortfall_ratio(self) -> float | None:
        if not self.scheduled_rate_per_s or self.achieved_rate_per_s is None:
            return None
        return 1.0 - self.achieved_rate_per_s / self.scheduled_rate_per_s

    def lag_s(self) -> dict:
        return distribution([r.lag_s for r in self.records if r.lag_s is not None])

    def warnings(self) -> list[str]:
        out = []
        short = self.rate_shortfall_ratio
        if short is not None and abs(short) > MAX_RATE_SHORTFALL_RATIO:
            out.append(f"load generator off its schedule: achieved "
                       f"{self.achieved_rate_per_s:.2f} req/s vs scheduled "
                       f"{self.scheduled_rate_per_s:.2f} req/s ({100 * short:+.1f}% short)")
        if self.cpu_percent > MAX_CPU_PERCENT:
            out.append(f"load generator used {self.cpu_percent:.0f}% of a core: it may be "
                       "the bottleneck")
        if self.cpu_wait_s is not None and self.cpu_wait_s > MAX_CPU_WAIT_RATIO * self.wall_s:
            out.append(f"the OS kept the load generator waiting for a CPU {self.cpu_wait_s:.1f}"
                       f" s of {self.wall_s:.1f} s: the machine is oversubscribed, so latencies "
                       "and send times include that wait")
        if self.gc_pause_max_s is not None and self.gc_pause_max_s > MAX_GC_PAUSE_S:
            out.append(f"the load generator's own garbage collector paused it "
                       f"{1000 * self.gc_pause_max_s:.0f} ms: every latency it measured "
                       "across that pause includes it")
        if self.loop_lag_max_s is not None and self.loop_lag_max_s > MAX_LOOP_LAG_S:
            out.append(f"the load generator's event loop ran {1000 * self.loop_lag_max_s:.0f} ms "
                       "late at once (busy, or kept off a CPU): every stream in flight then "
                       "shows that gap")
        return out


def run_queue_wait_s(pid: int | str = "self") -> float | None:
    """Seconds process ``pid``'s main thread (default: this one's) has spent runnable but off
    a CPU: Linux's ``/proc/<pid>/schedstat`` (cpu ns, run-queue wait ns, time slices); None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _raise_fd_limit(wanted: int) -> None:
    """Make room for one socket per concurrent request (best effort)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


class GcPauses:
    """How long Python's cyclic collector held this process during a run (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self.total_s = 0.0
        self.count = 0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            pause_s = time.perf_counter() - self._start
            self._start = None
            self.count += 1
            self.total_s += pause_s
            self.longest_s = max(self.longest_s, pause_s)


@contextlib.contextmanager
def loop_lag() -> Iterator[LoopLag]:
    """The generator's own event-loop lag during a run (``guard.observe.loop_lag.LoopLag``: a 10 ms
    timer's largest lateness), on the running loop. The generator timestamps every chunk it
    reads on that loop, so a loop late by L — busy with other users' work, kept off a CPU by
    the OS or by the host of the virtual machine, or held by a collection — adds up to L to a
    gap of every stream in flight at once, whatever the server did. Seen here: sends up to
    0.2 s late and a ~0.15–0.2 s gap in every in-flight stream of a quick chaos run, through
    both proxies and both replicas at once, in one of two runs of the same arrivals (the send
    lag's p99 stayed under its bound in some of them). With ``MAX_LOOP_LAG_S`` such a run is
    invalid, as one with a long GC pause is. Measured from the run's start: building the
    clients before it (the OpenAI SDK's first import: ~0.5 s) is no part of the run."""
    lag = LoopLag()
    lag.start()
    try:
        yield lag
    finally:
        lag.stop()


@contextlib.contextmanager
def few_collections(gen0_threshold: int = 20_000) -> Iterator[GcPauses]:
    """Keep Python's cyclic GC from eating the generator's CPU, and from stalling it, during a
    run: what exists already (the schedule, the bodies) is frozen out of collection, a young
    collection runs every ``gen0_threshold`` allocations instead of every 700, and the oldest
    generation is not collected at all until the run ends. With thousands of requests in flight
    each collection walks every live task and buffer: at 1,000 sheds/s the default thresholds
    cost the generator ~35 % of its CPU (1.15 ms vs 0.75 ms per request against a trivial
    loopback server answering 503s, as ``kvguard bench loadgen --answer shed`` runs). A full
    collection walks everything the run made: 0.22–0.28 s in a quick chaos run's generator,
    a stall of every stream it measures at once, seen as one over-limit gap in each (what had
    been taken for a stall of the replicas at a restart). The thresholds are restored after
    (the full collection comes then, outside the measurement) and the frozen set unfrozen
    (anything frozen before the run is unfrozen with it). Yields the run's ``GcPauses``."""
    before = gc.get_threshold()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    gc.freeze()
    gc.set_threshold(gen0_threshold, before[1], _NO_FULL_COLLECTION)
    try:
        yield pauses
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
        gc.callbacks.remove(pauses)


def _bodies(specs: list[RequestSpec], cfg: LoadConfig) -> list[bytes]:
    return [request_body(cfg.model, json.dumps(prompt_token_ids(cfg.seed, s)), s.max_tokens)
            for s in specs]


async def _counted(client: CompletionClient, spec: RequestSpec, body: bytes, t0_s: float,
                   counts: LiveCounts) -> RequestRecord:
    record = await client.send(spec, body, t0_s)
    counts.by_outcome[record.outcome] += 1
    return record


async def _dispatch(client, specs, bodies, t0_s, counts, clock) -> list[asyncio.Task]:
    tasks = []
    for spec, body in zip(specs, bodies, strict=True):
        delay_s = t0_s + spec.scheduled_s - clock()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        counts.num_sent += 1
        tasks.append(asyncio.create_task(_counted(client, spec, body, t0_s, counts)))
    return tasks


def _never_sent(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(index=spec.index, request_class=spec.request_class, tenant=spec.tenant,
                         num_prompt_tokens=spec.num_prompt_tokens, max_tokens=spec.max_tokens,
                         scheduled_s=spec.scheduled_s, sent_s=None, outcome="canceled",
                         error="canceled at drain deadline before sending")


async def _drain(tasks: list[asyncio.Task], specs: list[RequestSpec], deadline_s: float,
                 clock) -> list[RequestRecord]:
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=max(0.0, deadline_s - clock()))
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still)
    return [_never_sent(s) if t.cancelled() else t.result()
            for t, s in zip(tasks, specs, strict=True)]


async def run_load(specs: list[RequestSpec], cfg: LoadConfig,
                   on_tick: Callable[[LiveCounts, float], None] | None = None,
                   tick_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                   bodies: Sequence[bytes] | None = None) -> LoadResult:
    """Run the schedule against ``cfg.url``; ``on_tick(counts, elapsed_s)`` reports progress.
    ``bodies``: one request body per spec (default: seeded random prompts of each spec's size)."""
    _raise_fd_limit(cfg.max_connections + 256)
    if bodies is None:
        bodies = _bodies(specs, cfg)
    elif len(bodies) != len(specs):
        raise ValueError(f"bodies: {len(bodies)} bodies for {len(specs)} requests")
    counts = LiveCounts(len(specs))
    proc = psutil.Process()
    with few_collections() as gc_pauses:
        result = await _run(specs, bodies, cfg, counts, proc, on_tick, tick_s, clock)
    return dataclasses.replace(result, gc_pause_max_s=gc_pauses.longest_s)


async def _run(specs, bodies, cfg: LoadConfig, counts: LiveCounts, proc, on_tick, tick_s: float,
               clock) -> LoadResult:
    async with _completion_client(cfg, clock) as client:
        cpu0, wait0, t0_s = sum(proc.cpu_times()[:2]), run_queue_wait_s(), clock()
        ticker = asyncio.create_task(_tick(on_tick, counts, t0_s, tick_s, clock))
        try:
            with loop_lag() as lag:  # from the run's start: the client is built before it
                tasks = await _dispatch(client, specs, bodies, t0_s, counts, clock)
                records = await _drain(tasks, specs, t0_s + cfg.duration_s + cfg.drain_timeout_s,
                                       clock)
        finally:
            ticker.cancel()
        wall_s, cpu_s, wait1 = clock() - t0_s, sum(proc.cpu_times()[:2]) - cpu0, run_queue_wait_s()
    if on_tick is not None:
        on_tick(counts, wall_s)
    return LoadResult(
        records=tuple(records), duration_s=cfg.duration_s, wall_s=wall_s, cpu_s=cpu_s,
        scheduled_rate_per_s=rate_of([s.scheduled_s for s in specs]),
        achieved_rate_per_s=sustained_rate_of(records),
        cpu_wait_s=None if wait0 is None or wait1 is None else wait1 - wait0,
        loop_lag_max_s=lag.max_lag_s,
    )


@contextlib.asynccontextmanager
async def _completion_client(cfg: LoadConfig, clock) -> AsyncIterator[CompletionClient]:
    """The configured client (``cfg.client``), its connections closed after the run."""
    kwargs = {"model": cfg.model, "timeout_s": cfg.timeout_s, "class_header": cfg.class_header,
              "clock": clock}
    if cfg.client == "raw":
        parts = urlsplit(cfg.url)
        pool = RawConnectionPool(parts.hostname, parts.port or 80, cfg.max_connections)
        try:
            yield RawCompletionClient(pool, cfg.url, **kwargs)
        finally:
            pool.close()
        return
    async with make_http_client(cfg.max_connections) as http:
        yield CompletionClient(http, cfg.url, **kwargs)


async def _tick(on_tick, counts: LiveCounts, t0_s: float, tick_s: float, clock) -> None:
    if on_tick is None:
        return
    while True:
        await asyncio.sleep(tick_s)
        on_tick(counts, clock() - t0_s)
