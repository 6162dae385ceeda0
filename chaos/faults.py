"""Faults on the run's clock, injected by signal into a ``chaos.topology.Topology``.

    plan = (Fault("replica_kill", at_s=10.0, duration_s=5.0, target=0),   # restart 5 s later
            Fault("redis_hang", at_s=12.0, duration_s=4.0))               # SIGCONT 4 s later
    events = await inject(plan, topology, t0_s)

Kinds (``duration_s`` is what follows the fault; None = nothing follows):

- ``replica_kill``  SIGKILL replica ``target``; restart it ``duration_s`` later (same port).
- ``replica_kill_hot``  SIGKILL the replica that holds the hottest prefix in its cache (asked
  at the time of the fault: ``inject``'s ``hot_replica`` probes the replicas); restart it
  ``duration_s`` later, cold. ``target`` is ignored.
- ``replica_hang``  SIGSTOP replica ``target``; SIGCONT ``duration_s`` later.
- ``proxy_kill``    SIGKILL proxy ``target`` (one of M behind the clients' round-robin);
  restart it ``duration_s`` later.
- ``epp_kill``      SIGKILL ``kvguard epp`` ``target`` (one of the EPPs behind Envoy);
  restart it ``duration_s`` later.
- ``redis_kill``    SIGKILL the redis-server; restart it ``duration_s`` later.
- ``redis_hang``    SIGSTOP the redis-server; SIGCONT ``duration_s`` later.
- ``rate_step``     the arrival rate steps up at ``at_s`` and back down ``duration_s`` later.
  The schedule enacts it (arrivals are planned before the run); here it is only recorded.

Every action is recorded as a ``FaultEvent`` with its run time, for the verdict and the plot.
Blocking steps (reaping a killed pid, waiting for a restarted child to be healthy) run in a
worker thread so that the load generator's event loop never stalls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["FAULT_KINDS", "KILL_KINDS", "Fault", "FaultEvent", "validate_plan", "inject",
           "scaled"]

FAULT_KINDS: tuple[str, ...] = ("replica_kill", "replica_kill_hot", "replica_hang",
                                "proxy_kill", "epp_kill", "redis_kill", "redis_hang", "rate_step")
KILL_KINDS = frozenset({"replica_kill", "replica_kill_hot"})  # a replica SIGKILLed
_ACTIONS: dict[str, tuple[str, str]] = {  # kind -> (fault action, recovery action)
    "replica_kill": ("kill", "restart"), "replica_kill_hot": ("kill", "restart"),
    "proxy_kill": ("kill", "restart"), "epp_kill": ("kill", "restart"),
    "redis_kill": ("kill", "restart"), "replica_hang": ("stop", "cont"),
    "redis_hang": ("stop", "cont"), "rate_step": ("rate up", "rate down"),
}
_NEEDS_DURATION = frozenset({"replica_hang", "redis_hang", "rate_step"})


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float
    duration_s: float | None = None
    target: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.at_s < 0 or self.target < 0:
            raise ValueError(f"fault {self.kind}: at_s and target must be >= 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"fault {self.kind}: duration_s must be > 0 or None")
        if self.kind in _NEEDS_DURATION and self.duration_s is None:
            raise ValueError(f"fault {self.kind} needs duration_s (when it ends)")

    @property
    def end_s(self) -> float | None:
        return None if self.duration_s is None else self.at_s + self.duration_s

    @property
    def component(self) -> str:
        return self.kind.split("_", 1)[0]

    def target_name(self) -> str:
        return self.component if self.component in ("redis", "rate") else \
            f"{self.component}-{self.target}"


def scaled(fault: Fault, scale: float) -> Fault:
    """The same fault with its times multiplied by ``scale`` (GPU seconds -> wall seconds)."""
    return Fault(fault.kind, fault.at_s * scale,
                 None if fault.duration_s is None else fault.duration_s * scale, fault.target)


@dataclass(frozen=True)
class FaultEvent:
    t_s: float         # run seconds when the action was taken (or finished, for "healthy")
    kind: str
    target: str
    action: str        # kill | restart | healthy | stop | cont | rate up | rate down | failed
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _child(topology, fault: Fault):
    if fault.component == "replica":
        children = topology.replicas
    elif fault.component == "proxy":
        children = topology.proxies
    elif fault.component == "epp":
        children = topology.epps
    else:
        return topology.redis
    return children[fault.target] if fault.target < len(children) else None


def validate_plan(plan: Sequence[Fault], topology) -> None:
    """Every fault names a process the topology has (ValueError otherwise)."""
    for f in plan:
        if f.kind != "rate_step" and _child(topology, f) is None:
            raise ValueError(f"fault {f.kind} targets {f.target_name()}, which this topology "
                             "does not run")


async def _act(child, action: str) -> None:
    if action == "stop":
        child.stop()
    elif action == "cont":
        child.cont()
    elif action == "kill":
        await asyncio.to_thread(child.kill)
    elif action == "restart":
        await asyncio.to_thread(child.restart)


async def _run_one(fault: Fault, topology, t0_s: float, clock, sleep, events: list,
                   hot_replica: Callable[[], Awaitable[int]] | None = None) -> None:
    """The fault's action at its time, then its recovery ``duration_s`` after the action
    actually happened (a late action on a starved loop keeps the fault's full length)."""
    child = _child(topology, fault)
    name = fault.target_name()
    if fault.kind == "replica_kill_hot":
        wait_s = t0_s + fault.at_s - clock()
        if wait_s > 0:  # who holds the hottest prefix is asked when the fault strikes
            await sleep(wait_s)
        index = await hot_replica() if hot_replica is not None else 0
        child, name = topology.replicas[index], f"replica-{index}"
    steps = [(fault.at_s, _ACTIONS[fault.kind][0])]
    if fault.end_s is not None:
        steps.append((fault.end_s, _ACTIONS[fault.kind][1]))
    struck_s = None
    for at_s, action in steps:
        due_s = t0_s + at_s
        if struck_s is not None and fault.kind != "rate_step":
            due_s = max(due_s, struck_s + fault.duration_s)
        if due_s - clock() > 0:
            await sleep(due_s - clock())
        struck_s = clock() if struck_s is None else struck_s
        events.append(FaultEvent(clock() - t0_s, fault.kind, name, action))
        if fault.kind == "rate_step":
            continue
        try:
            await _act(child, action)
        except Exception as exc:  # recorded, never fatal to the run
            events.append(FaultEvent(clock() - t0_s, fault.kind, name, "failed",
                                     f"{action}: {type(exc).__name__}: {exc}"[:300]))
            return
        if action == "restart":
            events.append(FaultEvent(clock() - t0_s, fault.kind, name, "healthy"))


async def inject(plan: Sequence[Fault], topology, t0_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 hot_replica: Callable[[], Awaitable[int]] | None = None) -> list[FaultEvent]:
    """Carry out ``plan`` against ``topology`` on the run clock (``t0_s`` = run start);
    returns the events in time order once every step is done. ``hot_replica``: the index of
    the replica holding the hottest prefix (for ``replica_kill_hot``; default replica 0)."""
    validate_plan(plan, topology)
    events: list[FaultEvent] = []
    await asyncio.gather(*(_run_one(f, topology, t0_s, clock, sleep, events, hot_replica)
                           for f in plan))
    return sorted(events, key=lambda e: e.t_s)
