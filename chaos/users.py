"""The open-loop user runner: each planned arrival is one user whose client starts on time.

Arrivals never wait for responses (a dispatcher sleeps until each arrival and starts a task
for it). Each user's client makes as many attempts as its kind does, spread round-robin over
the entry URLs. After the schedule ends the clients get ``drain_timeout_s`` to finish; any
still running are canceled and recorded from what they had done so far. A client canceled
in the middle of an attempt older than that attempt's own limit (+ ``hang_grace_s``) is
**hung**: it was not honouring its timeout.

The generator checks itself as ``kvguard load`` does: the achieved first-attempt send rate
against the schedule's, its send lag and its own CPU (``LoadResult.warnings``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from chaos.client import make_http_client
from chaos.client_factory import make_user_client
from chaos.clients import ClientConfig, EntryPicker, UserProgress, user_record
from chaos.load import (
    LoadResult,
    _raise_fd_limit,
    few_collections,
    loop_lag,
    rate_of,
    run_queue_wait_s,
    sustained_rate_of,
)
from chaos.records import RequestRecord, RequestSpec
from chaos.schedule import prompt_token_ids
from chaos.user_record import UserRecord

__all__ = ["UserRunConfig", "UserRunResult", "assign_clients", "run_users"]

MAX_LAG_P99_S = 0.1


@dataclass(frozen=True)
class UserRunConfig:
    entry_urls: tuple[str, ...]
    duration_s: float
    drain_timeout_s: float
    seed: int = 0
    model: str | None = None
    max_connections: int = 4096
    class_header: str = "x-kvguard-class"
    hang_grace_s: float = 1.0

    def __post_init__(self) -> None:
        EntryPicker(self.entry_urls)  # validates: non-empty, loopback only
        if self.duration_s <= 0 or self.drain_timeout_s < 0 or self.hang_grace_s <= 0:
            raise ValueError("need duration_s > 0, drain_timeout_s >= 0, hang_grace_s > 0")


@dataclass(frozen=True)
class UserRunResult:
    users: tuple[UserRecord, ...]
    load: LoadResult  # over first attempts: the generator's own rate, lag and CPU
    entries: dict = field(default_factory=dict)  # EntryPicker.summary(): refused connects

    def warnings(self) -> list[str]:
        out = self.load.warnings()
        p99 = self.load.lag_s().get("p99")
        if p99 is not None and p99 > MAX_LAG_P99_S:
            out.append(f"load generator send lag p99 {1000 * p99:.0f} ms > "
                       f"{1000 * MAX_LAG_P99_S:.0f} ms: arrivals left late")
        return out


def assign_clients(specs: Sequence[RequestSpec], mix: Mapping[str, float],
                   seed: int) -> list[str]:
    """One client kind per user, drawn by weight from ``mix`` with a seeded generator."""
    if not mix or any(w <= 0 for w in mix.values()):
        raise ValueError(f"client mix needs positive weights, got {dict(mix)}")
    rng = random.Random(f"clients-{seed}")
    kinds, weights = list(mix), list(mix.values())
    return [rng.choices(kinds, weights=weights)[0] for _ in specs]


def _first_attempt(spec: RequestSpec, user: UserRecord) -> RequestRecord:
    if user.attempts:
        return user.attempts[0]
    return RequestRecord(index=spec.index, request_class=spec.request_class, tenant=spec.tenant,
                         num_prompt_tokens=spec.num_prompt_tokens, max_tokens=spec.max_tokens,
                         scheduled_s=spec.scheduled_s, sent_s=None, outcome="canceled",
                         error="never sent")


class _Users:
    """The clients of one run and each user's progress (event-loop only)."""

    def __init__(self, clients: Mapping[str, object], cfgs: Mapping[str, ClientConfig]):
        self.clients, self.cfgs = clients, cfgs
        self.progress: list[UserProgress] = []

    def start(self, spec: RequestSpec, kind: str, prompt_ids: list[int],
              t0_s: float) -> asyncio.Task:
        progress = UserProgress()
        self.progress.append(progress)
        return asyncio.create_task(self.clients[kind].serve(spec, prompt_ids, t0_s, progress))

    def overdue(self, kind: str, i: int, now_s: float, grace_s: float) -> bool:
        """Inside an attempt older than its own limit + ``grace_s``."""
        p = self.progress[i]
        return p.attempt_started_s is not None and \
            now_s - p.attempt_started_s > self.cfgs[kind].attempt_limit_s + grace_s

    def salvage(self, spec: RequestSpec, kind: str, i: int, hung: bool) -> UserRecord:
        """The record of a user whose client had to be canceled."""
        return user_record(spec, self.cfgs[kind], self.progress[i].attempts, hung=hung,
                           final_error="canceled at drain deadline")


async def _dispatch(users: _Users, specs, kinds, prompts, t0_s, clock) -> list[asyncio.Task]:
    tasks = []
    for spec, kind, ids in zip(specs, kinds, prompts, strict=True):
        delay_s = t0_s + spec.scheduled_s - clock()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(users.start(spec, kind, ids, t0_s))
    return tasks


async def _drain(users: _Users, tasks, specs, kinds, deadline_s, cfg, clock) -> list[UserRecord]:
    """Wait until the deadline; cancel the rest. A client that looks overdue gets one more
    grace period (stretched by however late this loop woke: a starved event loop fires
    timeouts late) to end on its own before it is called hung."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, deadline_s - clock()))
    now_s = clock()
    lag_s = max(0.0, now_s - deadline_s)
    overdue = {i for i, t in enumerate(tasks)
               if not t.done() and users.overdue(kinds[i], i, now_s, cfg.hang_grace_s)}
    salvaged = {i: users.salvage(specs[i], kinds[i], i, hung=False)
                for i, t in enumerate(tasks) if not t.done() and i not in overdue}
    for i in salvaged:
        tasks[i].cancel()
    if overdue:
        await asyncio.wait([tasks[i] for i in overdue], timeout=cfg.hang_grace_s + lag_s)
        salvaged |= {i: users.salvage(specs[i], kinds[i], i, hung=True)
                     for i in overdue if not tasks[i].done()}
    still = [tasks[i] for i in salvaged if not tasks[i].done()]
    for t in still:
        t.cancel()
    if still:
        await asyncio.wait(still, timeout=cfg.hang_grace_s + 5.0)
    return [salvaged[i] if i in salvaged else t.result() for i, t in enumerate(tasks)]


async def run_users(specs: Sequence[RequestSpec], kinds: Sequence[str],
                    client_cfgs: Mapping[str, ClientConfig], cfg: UserRunConfig,
                    clock: Callable[[], float] = time.monotonic,
                    on_start: Callable[[float], None] | None = None) -> UserRunResult:
    """Run every user of ``specs`` (client kind ``kinds[i]``) against ``cfg.entry_urls``.
    ``on_start(t0_s)`` is called with the run start (on ``clock``) once the clients are built,
    so that a fault plan can share the run clock."""
    if len(kinds) != len(specs) or set(kinds) - set(client_cfgs):
        raise ValueError("every user needs a client kind that has a ClientConfig")
    _raise_fd_limit(cfg.max_connections + 256)
    entries = EntryPicker(cfg.entry_urls)
    prompts = [prompt_token_ids(cfg.seed, s) for s in specs]  # before the clock: ~1 ms each
    with few_collections() as gc_pauses:  # the prompts are frozen out of collection too
        result = await _run_users(specs, kinds, client_cfgs, cfg, clock, on_start, entries,
                                  prompts)
    return dataclasses.replace(result, load=dataclasses.replace(
        result.load, gc_pause_max_s=gc_pauses.longest_s))


async def _run_users(specs, kinds, client_cfgs, cfg: UserRunConfig, clock, on_start, entries,
                     prompts) -> UserRunResult:
    proc = psutil.Process()
    async with make_http_client(cfg.max_connections) as http:
        clients = {k: make_user_client(c, http, entries, model=cfg.model,
                                       class_header=cfg.class_header, clock=clock)
                   for k, c in client_cfgs.items() if k in set(kinds)}
        users = _Users(clients, client_cfgs)
        cpu0, wait0, t0_s = sum(proc.cpu_times()[:2]), run_queue_wait_s(), clock()
        if on_start is not None:
            on_start(t0_s)
        try:
            with loop_lag() as lag:  # from the run's start: the clients are built before it
                tasks = await _dispatch(users, specs, kinds, prompts, t0_s, clock)
                records = await _drain(users, tasks, list(specs), list(kinds),
                                       t0_s + cfg.duration_s + cfg.drain_timeout_s, cfg, clock)
        finally:
            for c in clients.values():
                if hasattr(c, "aclose"):
                    await c.aclose()
        wall_s, cpu_s, wait1 = clock() - t0_s, sum(proc.cpu_times()[:2]) - cpu0, run_queue_wait_s()
    firsts = [_first_attempt(s, u) for s, u in zip(specs, records, strict=True)]
    load = LoadResult(
        records=tuple(firsts), duration_s=cfg.duration_s, wall_s=wall_s, cpu_s=cpu_s,
        scheduled_rate_per_s=rate_of([s.scheduled_s for s in specs]),
        achieved_rate_per_s=sustained_rate_of(firsts),
        cpu_wait_s=None if wait0 is None or wait1 is None else wait1 - wait0,
        loop_lag_max_s=lag.max_lag_s)
    return UserRunResult(tuple(records), load, entries.summary())
