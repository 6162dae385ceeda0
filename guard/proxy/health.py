"""Which replicas the proxy may route to: passive ejection and active probes.

Two signals make a replica unroutable:

* the state poller (:class:`guard.replicas.poller.StatePoller`) marks it unhealthy after
  ``unhealthy_after_errors`` consecutive failed state polls, and healthy again on the next good
  one;
* :class:`ReplicaHealth` ejects it after ``eject_after_failures`` consecutive request failures
  (connect errors, timeouts, 5xx answers other than 503). An ejected replica is marked unhealthy in the load
  state at once, its state source is gated (every poll fails while it is ejected, so a good poll
  in flight cannot make it routable again), and from ``probe_interval_s`` after the ejection
  its ``GET /health`` is probed every ``probe_interval_s`` (a 404 there: its ``GET /v1/models``,
  as llama-cpp-python's server has no ``/health``); the first 2xx re-admits it, and the
  next state poll makes it routable.

Policies only pick healthy replicas, so no request is routed to an ejected one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from guard.background import cancel_and_wait
from guard.replicas.poller import StateSource

__all__ = ["ReplicaHealth", "GatedSource", "ReplicaEjected"]

log = logging.getLogger(__name__)

# probe(replica_id) -> True when the replica answers its health check
Probe = Callable[[str], Awaitable[bool]]


class ReplicaEjected(RuntimeError):
    """The replica is ejected: its state is not read until a probe re-admits it."""

    quiet = True  # the ejection was logged; the state poller records it without a line

    def __str__(self) -> str:
        return "ejected after failing requests; probed until its /health answers"


class GatedSource:
    """A state source that fails while its replica is ejected (checked before and after)."""

    def __init__(self, replica_id: str, inner: StateSource, health: ReplicaHealth) -> None:
        self.replica_id = replica_id
        self.local = getattr(inner, "local", False)  # answers without I/O (StatePoller)
        self.max_model_len = getattr(inner, "max_model_len", None)
        self._inner = inner
        self._health = health

    @property
    def kind(self) -> str:
        """The inner source's kind now (``auto`` settles on one at its first answer)."""
        return self._inner.kind

    async def fetch(self) -> Any:
        if self._health.is_ejected(self.replica_id):
            raise ReplicaEjected(self.replica_id)
        document = await self._inner.fetch()
        if self._health.is_ejected(self.replica_id):
            raise ReplicaEjected(self.replica_id)
        return document

    def listen(self, listener: Any) -> None:
        """A pushing inner source (a stream): its updates, dropped while ejected."""
        self._inner.listen(lambda payload: None if self._health.is_ejected(self.replica_id)
                           else listener(payload))

    @property
    def pushes(self) -> bool:
        return hasattr(self._inner, "listen")

    @property
    def answers_now(self) -> bool:
        """The inner source's (a live stream's fetch waits on nothing: StatePoller), but never
        while ejected: the poller's round then fetches it, and records the ejection, where it
        skips a live stream that pushes."""
        return not self._health.is_ejected(self.replica_id) \
            and getattr(self._inner, "answers_now", False)

    async def aclose(self) -> None:
        """Close the inner source's own connection, where it holds one (a stream)."""
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()


class ReplicaHealth:
    """Consecutive request failures per replica, ejection, and the probe loop.

    ``mark_unhealthy(replica_id)`` is the load state's (policies stop picking the replica);
    ``probe`` answers whether an ejected replica is back.
    """

    def __init__(self, replica_ids: Iterable[str], eject_after_failures: int,
                 probe_interval_s: float, mark_unhealthy: Callable[[str], None],
                 probe: Probe, clock: Callable[[], float]) -> None:
        if eject_after_failures < 1 or not probe_interval_s > 0:
            raise ValueError("ReplicaHealth: eject_after_failures >= 1, probe_interval_s > 0")
        self._failures = dict.fromkeys(replica_ids, 0)
        self._ejected: dict[str, float] = {}  # replica id -> when it may be probed next
        self._eject_after = eject_after_failures
        self._probe_interval_s = probe_interval_s
        self._mark_unhealthy = mark_unhealthy
        self._probe = probe
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.num_ejections = dict.fromkeys(self._failures, 0)
        self.num_readmissions = dict.fromkeys(self._failures, 0)

    def add(self, replica_id: str) -> None:
        """A replica joined the fleet."""
        self._failures.setdefault(replica_id, 0)
        self.num_ejections.setdefault(replica_id, 0)
        self.num_readmissions.setdefault(replica_id, 0)

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet: no longer counted or probed."""
        for table in (self._failures, self._ejected, self.num_ejections, self.num_readmissions):
            table.pop(replica_id, None)

    def is_ejected(self, replica_id: str) -> bool:
        return replica_id in self._ejected

    def consecutive_failures(self, replica_id: str) -> int:
        return self._failures[replica_id]

    def record_success(self, replica_id: str) -> None:
        if replica_id in self._failures:  # else it left the fleet
            self._failures[replica_id] = 0

    def record_failure(self, replica_id: str) -> bool:
        """One failed request; True when this failure ejected the replica."""
        if replica_id not in self._failures:  # it left the fleet
            return False
        self._failures[replica_id] += 1
        if replica_id in self._ejected or self._failures[replica_id] < self._eject_after:
            return False
        self._ejected[replica_id] = self._clock() + self._probe_interval_s
        self.num_ejections[replica_id] += 1
        self._mark_unhealthy(replica_id)
        log.warning("proxy: replica %s ejected after %d consecutive failures", replica_id,
                    self._failures[replica_id])
        self._probe_while_ejected()
        return True

    def gate(self, replica_id: str, source: StateSource) -> GatedSource:
        return GatedSource(replica_id, source, self)

    async def probe_ejected(self) -> None:
        """Probe each ejected replica that is due; re-admit those that answer."""
        now_s = self._clock()
        due = sorted(rid for rid, probe_s in self._ejected.items() if probe_s <= now_s)
        results = await asyncio.gather(*(self._probe(rid) for rid in due),
                                       return_exceptions=True)
        for replica_id, ok in zip(due, results, strict=True):
            if ok is not True:
                self._ejected[replica_id] = self._clock() + self._probe_interval_s
                continue
            if self._ejected.pop(replica_id, None) is not None:
                self._failures[replica_id] = 0
                self.num_readmissions[replica_id] += 1
                log.info("proxy: replica %s answers again: re-admitted", replica_id)

    def start(self) -> None:
        """Probe ejected replicas from now on (on the running loop): the probe loop runs only
        while a replica is ejected, so a healthy fleet costs no wake-ups."""
        self._loop = asyncio.get_running_loop()
        self._probe_while_ejected()

    @property
    def probing(self) -> bool:
        """The probe loop is running (only while a replica is ejected)."""
        return self._task is not None and not self._task.done()

    def _probe_while_ejected(self) -> None:
        if self._loop is not None and self._ejected and (self._task is None or self._task.done()):
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        while self._ejected:
            await asyncio.sleep(max(0.02, self._probe_interval_s / 4))
            if self._ejected:
                try:
                    await self.probe_ejected()
                except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                    log.exception("proxy: probe round failed")

    async def stop(self) -> None:
        self._loop = None
        task, self._task = self._task, None
        await cancel_and_wait(task)
