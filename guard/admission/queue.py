"""A bounded admission queue, ordered by class priority, first attempts before retries, then
deadline (so under overload retries and the lowest class are shed first).

Each waiter is an asyncio future. :meth:`AdmissionQueue.pump` re-runs the admission decision
for every waiter in order (the caller's ``decide`` takes a fresh snapshot and, on admit, takes
the reservation itself, synchronously, so two waiters can never be admitted into the same
blocks); it resolves admitted and shed waiters and evicts those past their deadline with a
503 ``queue_timeout``. Every decision is told what waits ahead of it (:class:`QueuedAhead`:
the waiters still queued before it in the pump; for a newcomer, :meth:`AdmissionQueue.ahead_of`,
every waiter of its class priority or a more important one; each waiter expected on the
replicas holding the most of its prefix, where it has one), so the policy forecasts the
earliest start it can really have and says no at once when even that is too late.
:meth:`AdmissionQueue.run` pumps on every :meth:`wake` (a completion or a state refresh) and at
least every ``interval_s``. A full queue sheds its worst entry (lowest priority, a retry, latest
deadline) or the newcomer, whichever is worse, with a 503 ``queue_full``.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.cost import RequestCost
from policies.decision import Queue, Shed
from policies.shed_reasons import QUEUE_FULL, QUEUE_TIMEOUT
from policies.snapshot import NOTHING_AHEAD, QueuedAhead

__all__ = ["AdmissionQueue", "Waiter", "QUEUE_FULL", "QUEUE_TIMEOUT"]


# decide(cost, now_s, ahead) -> Queue (keep waiting), Shed (reject), or anything else (admitted).
Decide = Callable[[RequestCost, float, QueuedAhead], Any]


@dataclass(order=True)
class Waiter:
    sort_key: tuple[int, bool, float, int]
    cost: RequestCost = field(compare=False)
    until_s: float = field(compare=False)
    enqueued_s: float = field(compare=False)
    future: asyncio.Future = field(compare=False, repr=False)


class AdmissionQueue:
    def __init__(self, max_len: int, clock: Callable[[], float], interval_s: float = 0.02) -> None:
        if max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.max_len = max_len
        self.interval_s = interval_s
        self._clock = clock
        self._waiters: list[Waiter] = []  # kept sorted
        # (priority, is_retry) -> the replicas its waiters are expected on (empty: anywhere)
        # -> [requests, prompt tokens, blocks]
        self._by_rank: dict[tuple[int, bool], dict[tuple[str, ...], list[int]]] = {}
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    def waiters(self) -> tuple[Waiter, ...]:
        return tuple(self._waiters)

    def push(self, cost: RequestCost, until_s: float, now_s: float) -> Waiter | Shed:
        """Enqueue ``cost``; a full queue sheds its worst entry or returns a Shed for ``cost``."""
        key = (cost.request_class.priority, cost.is_retry, cost.deadline_s, next(self._seq))
        if len(self._waiters) >= self.max_len:
            if not self._waiters or key > self._waiters[-1].sort_key:
                return Shed(503, QUEUE_FULL)
            worst = self._waiters.pop()
            self._count(worst.cost, -1)
            _resolve(worst, Shed(503, QUEUE_FULL))
        waiter = Waiter(key, cost, until_s, now_s, asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter)
        self._count(cost, +1)
        self.wake()
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Drop a waiter whose client went away. ``False`` if it had already left the queue."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        self._count(waiter.cost, -1)
        return True

    def ahead_of(self, cost: RequestCost) -> QueuedAhead:
        """What a newcomer would wait behind: every waiter of its rank (class priority, then
        first attempts before retries) or a better one, each expected where its prefix is."""
        if not self._waiters:
            return NOTHING_AHEAD
        rank = (cost.request_class.priority, cost.is_retry)
        total = [0, 0, 0]
        held_total = [0, 0, 0]
        held: dict[str, tuple[int, int, int]] = {}
        for r, groups in self._by_rank.items():
            if r > rank:
                continue
            for replica_ids, group in groups.items():
                total = [a + b for a, b in zip(total, group, strict=True)]
                if replica_ids:
                    held_total = [a + b for a, b in zip(held_total, group, strict=True)]
                for rid in replica_ids:
                    n, tokens, blocks = held.get(rid, (0, 0, 0))
                    held[rid] = (n + group[0], tokens + group[1], blocks + group[2])
        if not total[0]:
            return NOTHING_AHEAD
        return QueuedAhead(*total, MappingProxyType(held), tuple(held_total))

    def _count(self, cost: RequestCost, sign: int) -> None:
        rank = (cost.request_class.priority, cost.is_retry)
        groups = self._by_rank.setdefault(rank, {})
        replica_ids = cost.best_hit_replicas()
        totals = groups.setdefault(replica_ids, [0, 0, 0])
        num_tokens, num_blocks = cost.footprint_at_best_hit()
        totals[0] += sign
        totals[1] += sign * num_tokens
        totals[2] += sign * num_blocks
        if totals[0] == 0:
            del groups[replica_ids]
            if not groups:
                del self._by_rank[rank]

    def pump(self, decide: Decide, now_s: float) -> int:
        """Re-decide every waiter in order, each behind the ones still queued before it;
        return how many left the queue."""
        kept: list[Waiter] = []
        num_left = 0
        ahead = NOTHING_AHEAD
        for waiter in self._waiters:
            if waiter.future.done():  # canceled by its owner
                num_left += 1
                self._count(waiter.cost, -1)
                continue
            result = _decide_one(waiter, decide, now_s, ahead)
            if result is None:
                kept.append(waiter)
                ahead = ahead.plus(*waiter.cost.footprint_at_best_hit(),
                                   waiter.cost.best_hit_replicas())
                continue
            _resolve(waiter, result)
            self._count(waiter.cost, -1)
            num_left += 1
        self._waiters = kept
        return num_left

    def wake(self) -> None:
        """Re-evaluate soon (a completion or a state refresh); free while nobody waits."""
        if self._wake is not None and self._waiters:
            self._wake.set()

    async def run(self, decide: Decide) -> None:
        """Pump on every wake and at least every ``interval_s`` while anyone waits."""
        loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        while True:
            timer = loop.call_later(self.interval_s, wake.set) if self._waiters else None
            try:
                await wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            wake.clear()
            if self._waiters:
                self.pump(decide, self._clock())


def _decide_one(waiter: Waiter, decide: Decide, now_s: float, ahead: QueuedAhead) -> Any:
    if now_s >= waiter.until_s:
        return Shed(503, QUEUE_TIMEOUT)
    result = decide(waiter.cost, now_s, ahead)
    if isinstance(result, Queue):
        waiter.until_s = result.until_s
        return Shed(503, QUEUE_TIMEOUT) if now_s >= result.until_s else None
    return result


def _resolve(waiter: Waiter, result: Any) -> None:
    if not waiter.future.done():
        waiter.future.set_result(result)
