"""``serving.eager_task.start_eagerly``: the first step runs before it returns, inside its own
task (the current task, in the task's own context), and the task then runs on like any other:
result, exception, cancellation before its scheduled first step, timeouts. No timed
assertions: every test drives the loop with callbacks and futures."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from serving.eager_task import start_eagerly

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def _start_from_callback(make_coro, then=None) -> tuple[asyncio.Task, list, list]:
    """``start_eagerly`` called from a loop callback (as the server's read callback calls it);
    returns the task, a copy of the trail the coroutine left by the time it returned, and the
    trail. ``then(task)`` runs in the same callback, before the task's own first step."""
    loop = asyncio.get_running_loop()
    trail: list = []
    started = loop.create_future()

    def callback() -> None:
        task = start_eagerly(loop, make_coro(trail))
        started.set_result((task, list(trail)))
        if then is not None:
            then(task)

    loop.call_soon(callback)
    task, seen = await started
    return task, seen, trail


def test_the_first_step_runs_before_it_returns_inside_its_own_task():
    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()

        async def app(trail):
            trail.append(("first step", asyncio.current_task()))
            trail.append(("resumed with", await gate))
            trail.append(("still", asyncio.current_task()))
            return "answer"

        task, seen, trail = await _start_from_callback(app)
        assert seen == [("first step", task)]  # ran before start_eagerly returned
        gate.set_result(7)
        assert await task == "answer"
        assert trail == [("first step", task), ("resumed with", 7), ("still", task)]

    asyncio.run(main())


def test_a_coroutine_that_ends_in_its_first_step_ends_its_task_with_its_outcome():
    async def main() -> None:
        async def returns(trail):
            trail.append("ran")
            return 42

        async def raises(trail):
            trail.append("ran")
            raise LookupError("in the first step")

        task, seen, _ = await _start_from_callback(returns)
        assert seen == ["ran"] and await task == 42
        task, seen, _ = await _start_from_callback(raises)
        assert seen == ["ran"]
        with pytest.raises(LookupError, match="in the first step"):
            await task

    asyncio.run(main())


def test_cancelled_before_its_scheduled_first_step_the_coroutine_sees_the_cancellation():
    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()

        async def app(trail):
            try:
                await gate
            except asyncio.CancelledError:
                trail.append("cancelled where it waited")
                raise

        task, seen, trail = await _start_from_callback(app, then=asyncio.Task.cancel)
        assert seen == []  # cancelled in the callback, before the loop ran its own first step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert trail == ["cancelled where it waited"]
        assert gate.cancelled()  # as Task.cancel() cancels what the task waits on

    asyncio.run(main())


def test_the_first_step_runs_in_the_tasks_own_context():
    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()

        async def app(trail):
            VAR.set("inside")
            await gate
            trail.append(VAR.get())

        task, _, trail = await _start_from_callback(app)
        assert VAR.get() == "unset"  # the caller's context is untouched
        gate.set_result(None)
        await task
        assert trail == ["inside"]  # the task resumed in the context its first step set

    asyncio.run(main())


def test_a_timeout_started_in_the_first_step_cancels_the_task_as_usual():
    async def main() -> None:
        async def app(trail):
            try:
                async with asyncio.timeout(0):  # needs the current task
                    await asyncio.get_running_loop().create_future()  # never done
            except TimeoutError:
                trail.append("timed out")
            return "after"

        task, _, trail = await _start_from_callback(app)
        assert await task == "after" and trail == ["timed out"]

    asyncio.run(main())


def test_inside_a_task_it_falls_back_to_a_scheduled_task():
    async def main() -> None:
        trail: list = []

        async def app():
            trail.append(asyncio.current_task())

        task = start_eagerly(asyncio.get_running_loop(), app())
        assert trail == []  # asyncio allows one current task: this one runs next iteration
        await task
        assert trail == [task]

    asyncio.run(main())
