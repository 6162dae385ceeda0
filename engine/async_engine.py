"""The engine loop: one background thread drives ``LLMEngine.step()`` beside an asyncio loop.

Only the engine thread touches the engine. The event loop sends it commands (add, abort)
through a locked deque and a condition variable; the thread applies them between steps, steps
while there is work, and sleeps on the condition when idle (no busy spin). Outputs come back
to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``, one callback per step.

Failures: a step that raises an exception carrying ``request_id`` fails that request only; any
other step exception fails the requests then in the engine (their streams raise
``EngineStepError``) and the loop keeps serving. The thread never dies from a request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.outputs import RequestOutput, StepResult
from engine.sampling_params import SamplingParams
from engine.trace import RequestTimeline

__all__ = [
    "AsyncEngine",
    "DuplicateRequestError",
    "EngineShutdownError",
    "EngineStepError",
    "RequestStream",
]

log = logging.getLogger(__name__)


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and admits no new request."""


class DuplicateRequestError(ValueError):
    """A request with this id is still in flight."""


class EngineStepError(RuntimeError):
    """The engine failed while serving this request; the request is finished."""


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; ends after the finished one."""

    def __init__(self, request_id: str, timeline: RequestTimeline,
                 abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.timeline = timeline
        self.finished = False
        self.finish_reason: str | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._abort = abort

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        """Cancel the request if it is still running (idempotent, never blocks)."""
        if not self.finished:
            self._abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Loop thread only."""
        if self.finished:
            return
        if isinstance(item, BaseException):
            self.finished, self.finish_reason = True, "error"
        elif item.finished:
            self.finished, self.finish_reason = True, item.finish_reason
        self._queue.put_nowait(item)


@dataclass(frozen=True)
class _Add:
    stream: RequestStream
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    ack: asyncio.Future
    cache_salt: str | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs an ``LLMEngine`` in one thread; ``start()`` must be called inside the event loop.

    ``on_step(result, state)`` runs in the engine thread after every step (metrics hook);
    ``state`` is the engine's latest ``state()`` dict, refreshed at most every
    ``state_interval_s`` while stepping, and at once after an abort, a failure, or when the
    engine runs out of work (so an idle replica always reports its final, all-free state).
    """

    def __init__(self, engine, *, clock: Callable[[], float] = time.monotonic,
                 on_step: Callable[[StepResult, dict], None] | None = None,
                 idle_wait_s: float = 0.5, stall_timeout_s: float = 120.0,
                 state_interval_s: float = 0.02) -> None:
        self.engine = engine
        self._clock = clock
        self._on_step = on_step
        self._idle_wait_s = idle_wait_s
        self._stall_timeout_s = stall_timeout_s
        self._state_interval_s = state_interval_s
        self._state_dirty = False
        self._state_s = clock()
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._aborting: set[str] = set()  # engine thread only: abort outputs still to come
        self._live: dict[str, RequestStream] = {}  # loop thread only
        self._drained: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._admitting = True
        self._idle = True
        self._fatal: BaseException | None = None
        self._heartbeat_s = clock()
        self._last_batch_id = 0
        self._state: dict = engine.state()

    # ---- loop-side API -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent; call inside the event loop)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        self._drained.set()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def state(self) -> dict:
        """The engine's latest published ``state()`` (refreshed by the engine thread)."""
        return self._state

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, *, priority: int = 0,
                          timeline: RequestTimeline | None = None,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises ValueError (bad input,
        engine state unchanged), DuplicateRequestError, EngineShutdownError."""
        if not self._admitting or self._loop is None:
            raise EngineShutdownError("engine is not admitting requests")
        if request_id in self._live:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        timeline = timeline or RequestTimeline(request_id, arrival_s=self._clock())
        stream = RequestStream(request_id, timeline, self.abort)
        ack = self._loop.create_future()
        self._live[request_id] = stream
        self._drained.clear()
        self._send(_Add(stream, tuple(prompt_token_ids), params, priority, ack, cache_salt))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(stream)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (any thread; unknown ids are ignored)."""
        self._send(_Abort(request_id))

    def health(self) -> dict:
        """``ok`` only while admitting and the thread is alive and either idle-waiting or
        stepping on time (a step older than ``stall_timeout_s`` counts as hung)."""
        alive = self._thread is not None and self._thread.is_alive() and self._fatal is None
        age_s = self._clock() - self._heartbeat_s
        ok = alive and self._admitting and (self._idle or age_s < self._stall_timeout_s)
        return {"ok": ok, "alive": alive, "idle": self._idle, "heartbeat_age_s": age_s,
                "admitting": self._admitting, "num_in_flight": len(self._live),
                "error": None if self._fatal is None else repr(self._fatal)}

    async def shutdown(self, timeout_s: float) -> int:
        """Stop admitting, let in-flight requests finish within ``timeout_s``, abort the rest,
        stop the thread. Returns how many requests were aborted."""
        self._admitting = False
        if self._loop is None:
            return 0
        num_aborted = 0
        if not await self._wait_drained(timeout_s):
            num_aborted = len(self._live)
            for request_id in list(self._live):
                self.abort(request_id)
            await self._wait_drained(max(1.0, timeout_s))
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        return num_aborted

    async def _wait_drained(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _send(self, command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _forget(self, stream: RequestStream) -> None:
        if self._live.get(stream.request_id) is stream:
            del self._live[stream.request_id]
        if not self._live:
            self._drained.set()

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in items:
            stream._put(item)
            if stream.finished:
                self._forget(stream)

    @staticmethod
    def _resolve(ack: asyncio.Future, error: BaseException | None) -> None:
        if ack.done():
            return
        if error is None:
            ack.set_result(None)
        else:
            ack.set_exception(error)

    def _post(self, fn, *args) -> None:
        """Engine thread → loop thread."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if commands is None:
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                elif commands or self._state_dirty:
                    self._publish_state(force=True)
                self._heartbeat_s = self._clock()
        except BaseException as exc:  # a bug in the loop itself: report it, fail everyone
            log.exception("engine loop died")
            self._fatal = exc
            self._fail(list(self._streams), exc)

    def _next_commands(self) -> list | None:
        with self._cond:
            while not self._commands and not self.engine.has_unfinished_requests():
                if self._stop:
                    return None
                self._idle = True
                self._cond.wait(self._idle_wait_s)
                self._heartbeat_s = self._clock()
            self._idle = False
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            self._apply_abort(command.request_id)
            return
        stream = command.stream
        timeline = stream.timeline
        try:
            self.engine.add_request(stream.request_id, list(command.prompt_token_ids),
                                    command.params, priority=command.priority,
                                    arrival_s=timeline.arrival_s,
                                    cache_salt=command.cache_salt)
        except Exception as exc:  # ValueError: bad input, the engine is unchanged
            self._post(self._resolve, command.ack, exc)
            return
        timeline.enqueue_s = self._clock()
        timeline.num_prompt_tokens = len(command.prompt_token_ids)
        self._streams[stream.request_id] = stream
        self._post(self._resolve, command.ack, None)

    def _apply_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._state_dirty = True
        try:
            if self.engine.abort_request(request_id):
                self._aborting.add(request_id)
        except Exception:
            log.exception("abort_request(%r) failed", request_id)
        timeline = stream.timeline
        final = RequestOutput(request_id, (), True, "abort", timeline.num_prompt_tokens,
                              timeline.num_output_tokens, self._last_batch_id)
        self._post(self._deliver, [(stream, final)])

    def _step(self) -> None:
        start_s = self._clock()
        try:
            result = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            request_id = getattr(exc, "request_id", None)
            victims = [request_id] if request_id in self._streams else list(self._streams)
            self._fail(victims, exc)
            return
        now_s = self._clock()
        if result.iteration is not None:
            self._last_batch_id = result.iteration.batch_id
        refreshed = self._publish_state(force=not self.engine.has_unfinished_requests())
        self._dispatch(result, start_s, now_s, refreshed)
        if self._on_step is not None:
            try:
                self._on_step(result, self._state)
            except Exception:
                log.exception("on_step hook failed")

    def _dispatch(self, result: StepResult, start_s: float, now_s: float,
                  refreshed: bool) -> None:
        batch_id = self._last_batch_id
        running = self._scheduled_ids(result, refreshed)
        items = []
        for out in result.outputs:
            if out.finish_reason == "abort" and out.request_id in self._aborting:
                self._aborting.discard(out.request_id)  # ours, already delivered; the id
                continue  # may belong to a new request by now
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            running.discard(out.request_id)
            self._note_step(stream.timeline, batch_id, start_s, now_s)
            timeline = stream.timeline
            if out.new_token_ids and timeline.first_token_s is None:
                timeline.first_token_s = timeline.prefill_end_s = now_s
            timeline.num_output_tokens = out.num_output_tokens
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        if result.iteration is not None:
            for request_id in running:
                stream = self._streams.get(request_id)
                if stream is not None:
                    self._note_step(stream.timeline, batch_id, start_s, now_s)
        if items:
            self._post(self._deliver, items)

    def _scheduled_ids(self, result: StepResult, refreshed: bool) -> set[str]:
        """Requests in this step's batch beyond those with outputs (prefill chunks): from the
        step result when the engine reports them, else from a state refreshed this step."""
        scheduled = getattr(result, "scheduled_request_ids", None)
        if scheduled is not None:
            return set(scheduled)
        if not refreshed:
            return set()
        return {seq["request_id"] for seq in self._state.get("running", ())}

    @staticmethod
    def _note_step(timeline: RequestTimeline, batch_id: int, start_s: float,
                   end_s: float) -> None:
        if timeline.prefill_start_s is None:
            timeline.prefill_start_s = max(start_s, timeline.enqueue_s or start_s)
        timeline.iterations.append((batch_id, end_s))

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        items = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue
            try:
                if self.engine.abort_request(request_id):
                    self._aborting.add(request_id)
            except Exception:
                log.exception("abort_request(%r) failed after a step error", request_id)
            error = EngineStepError(f"engine failed: {exc!r}")
            error.__cause__ = exc
            items.append((stream, error))
        if items:
            self._post(self._deliver, items)
        self._publish_state(force=True)

    def _publish_state(self, force: bool = False) -> bool:
        """Refresh the published state at most every ``state_interval_s`` (``state()`` costs
        milliseconds at hundreds of sequences), at once when forced or after an abort."""
        now_s = self._clock()
        if not (force or self._state_dirty or now_s - self._state_s >= self._state_interval_s):
            return False
        try:
            self._state = self.engine.state()
        except Exception:
            log.exception("engine state() failed")
            return False
        self._state_s, self._state_dirty = now_s, False
        return True
