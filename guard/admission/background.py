"""The guard's background work: the admission-queue pump, the state poller and housekeeping.

All run on whichever event loop serves the guard. :meth:`Background.start` starts them on the
first request (or at ASGI lifespan startup): the pump task, then one state refresh awaited
before the first decision, then the poller's own task. A request arriving on a new event loop
(tests, a restarted server) starts them again there; what ran on the old loop is dropped.
:meth:`Background.aclose` stops them (safe to call twice).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from guard.replicas.poller import StatePoller

__all__ = ["Background"]


class Background:
    """``pump()`` makes the queue pump's coroutine; ``make_poller`` (None: no polling) the
    state poller; ``on_started`` runs once the first refresh is in; ``housekeeping()`` (optional)
    makes one more long-running coroutine (trace flush, lease renewal)."""

    def __init__(self, pump: Callable[[], Coroutine[Any, Any, None]],
                 make_poller: Callable[[], StatePoller] | None,
                 on_started: Callable[[], None],
                 housekeeping: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        self._pump = pump
        self._housekeeping = housekeeping
        self._make_poller = make_poller
        self._on_started = on_started
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready: asyncio.Future | None = None
        self.tasks: list[asyncio.Task] = []
        self.poller: StatePoller | None = None

    def is_running_here(self) -> bool:
        """Started, first refresh done, on the running loop (the per-request check)."""
        ready = self.ready
        return ready is not None and ready.done() and self.loop is asyncio.get_running_loop()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is loop and self.ready is not None:
            await asyncio.shield(self.ready)
            return
        if self.loop is not None:  # a new event loop: what ran on the old one is gone
            self.poller = None
        self.loop, self.ready = loop, loop.create_future()
        self.tasks = [loop.create_task(self._pump())]
        if self._housekeeping is not None:
            self.tasks.append(loop.create_task(self._housekeeping()))
        try:
            if self._make_poller is not None:
                self.poller = self.poller or self._make_poller()
                await self.poller.refresh_now()
                self.poller.start()
            self._on_started()
        finally:
            self.ready.set_result(None)

    async def aclose(self) -> None:
        """Stop the poller and the pump. Safe to call twice."""
        if self.loop is not asyncio.get_running_loop():  # they ran on a loop that is gone
            self.poller, self.tasks = None, []
        if self.poller is not None:
            await self.poller.stop()
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.loop = self.ready = None
