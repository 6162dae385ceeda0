"""Event-loop lag: how long the guard's event loop was busy when a timer should have fired.

Everything the guard does — pricing, deciding, shedding, relaying every token — runs on one
event loop, so a loop that is blocked delays every answer and stretches every stream's gaps at
once. :class:`LoopLag` wakes every ``interval_s`` and records how late it woke; the guard
exports the largest lag since start (``kvguard_event_loop_lag_max_seconds``).

The guard samples with :meth:`LoopLag.start`: a timer callback that re-arms itself (one loop
iteration per sample; a sleeping task took two, the timer's and the task's wake-up, plus a
future each time). :meth:`LoopLag.run` is the same sampling as a coroutine, on an injected clock
and sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["LoopLag"]


class LoopLag:
    """Samples the loop's lateness. ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(self, interval_s: float = 0.01, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_sample: Callable[[float], None] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"LoopLag: interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self.on_sample = on_sample
        self.max_lag_s = 0.0
        self.num_samples = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due_s = 0.0

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.num_samples += 1
        if lag_s > self.max_lag_s:
            self.max_lag_s = lag_s
        if self.on_sample is not None:
            self.on_sample(lag_s)

    async def run(self, max_samples: int | None = None) -> None:
        """Sample until cancelled (or ``max_samples`` taken)."""
        while max_samples is None or self.num_samples < max_samples:
            due_s = self._clock() + self.interval_s
            await self._sleep(self.interval_s)
            self.record(self._clock() - due_s)

    def start(self) -> None:
        """Sample on the running loop from a timer callback until :meth:`stop` (the loop's own
        clock; no task)."""
        self.stop()
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop = None

    def _arm(self) -> None:
        self._due_s = self._loop.time() + self.interval_s
        self._timer = self._loop.call_at(self._due_s, self._sample)

    def _sample(self) -> None:
        self.record(self._loop.time() - self._due_s)
        self._arm()
