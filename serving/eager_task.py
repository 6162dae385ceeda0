"""``start_eagerly(loop, coro)``: a task whose first step has already run, in the caller's call
stack (Python 3.12's eager tasks, for 3.11).

``loop.create_task`` only schedules a coroutine: its first step runs one event-loop iteration
later. The HTTP server starts each request's app from the connection's read callback; run
there at once, the app has priced, admitted and sent the request upstream before the loop
polls again (the proxy's whole request side, with no loop iteration in between).

The first step runs inside a real :class:`asyncio.Task`, made current for it
(``asyncio.current_task()`` is that task: timeouts, cancellation and ``uncancel`` work as in any
task) and in the task's own ``contextvars`` context. Where it stopped (the future it awaits) is
handed to the task's own first step, scheduled as usual, so from there on the task runs the
coroutine like any other. A coroutine that ended in its first step ends the task in that step
with its result or exception; a task cancelled before its scheduled first step throws the
cancellation into the coroutine where it stopped, as a cancelled task would.

Only from a callback (no task running on ``loop``); inside a task it falls back to
``loop.create_task`` (``asyncio`` allows one current task per loop).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
from collections.abc import Coroutine
from typing import Any

__all__ = ["start_eagerly"]

_enter_task = asyncio.tasks._enter_task
_leave_task = asyncio.tasks._leave_task
_current_task = asyncio.current_task
_RUNNING, _RETURNED, _RAISED = range(3)


class _Resumed(collections.abc.Coroutine):
    """The coroutine a task runs after its first step already ran eagerly: the task's first
    ``send`` gets what that step yielded (or its outcome); later calls go to the coroutine."""

    __slots__ = ("_coro", "_state", "_first")

    def __init__(self, coro: Coroutine) -> None:
        self._coro = coro
        self._state = _RUNNING
        self._first: Any = None  # what the eager step yielded, returned or raised

    def first_step(self) -> None:
        try:
            self._first = self._coro.send(None)
        except StopIteration as stop:
            self._state, self._first = _RETURNED, stop.value
        except BaseException as exc:  # noqa: BLE001 - the task raises it in its own step
            self._state, self._first = _RAISED, exc

    def _handover(self) -> Any:
        first, self._first = self._first, None
        state, self._state = self._state, None
        if state == _RUNNING:
            return first  # the future the coroutine awaits: the task waits on it now
        if state == _RETURNED:
            raise StopIteration(first)
        try:
            raise first
        finally:
            first = None  # no cycle through the traceback

    def send(self, value: Any) -> Any:
        if self._state is not None:
            return self._handover()
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        state, waited = self._state, self._first
        if state is not None and state != _RUNNING:
            return self._handover()  # it had ended: its own outcome stands
        self._state = self._first = None
        if state == _RUNNING and waited is not None:
            waited.cancel()  # cancelled before the task waited on it: as Task.cancel() does
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._state = self._first = None
        self._coro.close()

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine) -> asyncio.Task:
    """A task running ``coro``, its first step already run here (see the module docstring)."""
    if _current_task(loop) is not None:
        return loop.create_task(coro)
    resumed = _Resumed(coro)
    context = contextvars.copy_context()
    task = loop.create_task(resumed, context=context)
    _enter_task(loop, task)
    try:
        context.run(resumed.first_step)
    finally:
        _leave_task(loop, task)
    return task
