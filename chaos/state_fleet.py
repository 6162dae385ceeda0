"""Many state-only replicas in one process, each on its own loopback port (``kvguard fleet
--state-only``).

:class:`StateFleet` serves one :class:`chaos.state_replica.StateReplica` per port with
kvguard's own HTTP server (:class:`serving.h1server.H1Server`), all on one event loop, and
advances every replica every ``tick_s`` on the monotonic clock. Each answers what a sim engine
replica answers a guard or a load generator: ``GET /health``, ``GET /v1/models``,
``GET /kvguard/state`` (``?compact=1[&since_batch=N]`` too), and ``POST /v1/completions`` /
``/v1/chat/completions``, streamed (SSE, one event per token, ``[DONE]`` last) or not, with
``usage``; ``x-request-id`` names the sequence (so a guard's reservations retire). With
``time_scale`` K every step lasts K times the roofline's time (a GPU K times slower, as
``kvguard engine --time-scale K``), so K times the offered rate is what the fleet models. Prompt
tokens are the prompt's token ids when it is a list, else a quarter of its characters. Tokens
reach the client up to one ``tick_s`` after the step that made them ended.

Replicas join and leave while it runs (:meth:`StateFleet.add_replica`,
:meth:`StateFleet.remove_replica`): a removed replica's port stops answering.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from chaos.state_replica import StateReplica
from engine.compact_state import compact_state
from engine.config import model_preset
from engine.gpus import get_gpu
from engine.planner import num_kv_blocks
from engine.timing_model import TimingModel
from serving.draining_server import listening_socket
from serving.h1server import H1Server
from serving.json_body import loads
from serving.limited_protocol import ConnectionTable
from serving.server_limits import ServerLimits
from serving.state_delta import serve_state_stream, spread_phase
from serving.step_time_fit import StepTimeFit

__all__ = ["HELD_PROMPT_TOKENS", "STREAM_PHASES", "StateFleet", "StateFleetConfig",
           "stream_phase_of"]

HELD_PROMPT_TOKENS = 16  # the prompt of every held sequence (StateFleetConfig.held_running)
STREAM_PHASES = ("spread", "aligned")


def stream_phase_of(index: int, how: str) -> float:
    """The state stream phase (a fraction of its interval) of the fleet's ``index``-th
    replica: 0 when ``aligned``; ``spread``: ``index`` times the golden ratio's fraction, mod
    1 (:func:`serving.state_delta.spread_phase`), so any number of replicas spread their
    events evenly over the interval, the same in every run. A guard that asks a phase of its
    own (the ``phase`` query value) gets that one instead."""
    return spread_phase(index) if how == "spread" else 0.0


@dataclass(frozen=True)
class StateFleetConfig:
    """What every replica of the fleet models (the sim engine's defaults)."""

    model: str = "llama-7b"
    gpu: str = "h100-80g"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    tick_s: float = 0.005
    host: str = "127.0.0.1"
    time_scale: float = 1.0  # wall seconds per GPU second (chaos.state_replica)
    # KV blocks per replica; None: what the GPU's memory holds (the planner's figure). A small
    # number fills a replica with a request or two, so a fleet can be held saturated without
    # thousands of open streams (``kvguard bench scale --shed-flood``)
    num_kv_blocks: int | None = None
    # where in the interval each replica's state stream sends: "spread" gives every replica
    # its own phase (see ``stream_phase_of``), "aligned" none. One event loop serves every
    # replica here, so streams a guard opened at once would stay in step for good — every
    # interval the guard would get all of the fleet's events together — where separate
    # replica processes drift apart. Either way a guard that asks each stream for a phase of
    # its own (``?phase=``, as kvguard's does) gets that one
    stream_phase: str = "spread"
    # sequences every replica runs from its start without a client, each replaced by a new
    # one when it ends, so R stay running (``kvguard fleet --state-held-running R``): a fleet
    # busy with R × replicas sequences without that many open client connections. Prompts of
    # HELD_PROMPT_TOKENS, max_tokens spread over the upper half of max_model_len
    held_running: int = 0

    def __post_init__(self) -> None:
        if self.stream_phase not in STREAM_PHASES:
            raise ValueError(f"stream_phase must be one of {', '.join(STREAM_PHASES)}, "
                             f"got {self.stream_phase!r}")
        if not 0 < self.tick_s <= 1.0:
            raise ValueError(f"tick_s must be in (0, 1], got {self.tick_s!r}")
        scale = self.time_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (
                0 < scale < float("inf")):
            raise ValueError(f"time_scale must be a number > 0, got {scale!r}")
        held = self.held_running
        if isinstance(held, bool) or not isinstance(held, int) or held < 0:
            raise ValueError(f"held_running must be an int >= 0, got {held!r}")
        if held > self.max_num_seqs:
            raise ValueError(f"held_running {held} is over max_num_seqs {self.max_num_seqs}")
        keys = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for key in keys + (("num_kv_blocks",) if self.num_kv_blocks is not None else ()):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")


@dataclass
class _Served:
    replica: StateReplica
    server: H1Server
    url: str


class StateFleet:
    """State-only replicas on loopback ports, advanced together on one event loop."""

    def __init__(self, config: StateFleetConfig = StateFleetConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        model, gpu = model_preset(config.model), get_gpu(config.gpu)
        self._timing = TimingModel(model, gpu)
        self._timing_dict = self._timing.as_dict()
        self._num_blocks = config.num_kv_blocks or num_kv_blocks(
            model, gpu, 0.9, self._timing.dtype_bytes, 16, config.max_num_batched_tokens,
            config.max_num_seqs)
        if self._num_blocks < 1:
            raise ValueError(f"model {config.model!r} does not fit on gpu {config.gpu!r}")
        if config.held_running and config.max_model_len < 2 * HELD_PROMPT_TOKENS:
            raise ValueError(f"held_running needs max_model_len >= {2 * HELD_PROMPT_TOKENS}")
        self.config = config
        self._clock = clock
        self._served: dict[str, _Served] = {}
        self._ids = itertools.count()
        self._ticker: asyncio.Task | None = None
        # (when a replica's step in flight ends, tie-breaker, replica id): the tick advances
        # only the replicas due and the ones given work since the tick before
        self._due: list[tuple[float, int, str]] = []
        self._woken: set[str] = set()
        self._pushes = itertools.count()
        self._held_ids = itertools.count()

    @property
    def urls(self) -> dict[str, str]:
        """Replica id → base URL, for the replicas serving now."""
        return {rid: served.url for rid, served in self._served.items()}

    async def start(self, num_replicas: int) -> None:
        for _ in range(num_replicas):
            await self.add_replica()
        self._ticker = asyncio.ensure_future(self._tick())

    async def add_replica(self) -> str:
        """A new replica on a free port; its id (``replica-K``)."""
        cfg = self.config
        replica = StateReplica(self._timing.predict_s, num_total_blocks=self._num_blocks,
                               max_num_seqs=cfg.max_num_seqs,
                               max_num_batched_tokens=cfg.max_num_batched_tokens,
                               max_model_len=cfg.max_model_len, model=cfg.model,
                               timing_model=self._timing_dict, time_scale=cfg.time_scale)
        replica.now_s = self._clock()
        index = next(self._ids)
        replica_id = f"replica-{index}"
        server = H1Server(_ReplicaApp(replica, self._clock,
                                      lambda: self._woken.add(replica_id),
                                      stream_phase_of(index, cfg.stream_phase)),
                          ConnectionTable(ServerLimits()), lifespan=False,
                          graceful_timeout_s=1.0)
        sock = listening_socket(cfg.host, 0)
        port = sock.getsockname()[1]
        await server.start([sock])
        self._served[replica_id] = _Served(replica, server, f"http://{cfg.host}:{port}")
        for index in range(cfg.held_running):
            self._hold(replica_id, replica, index)
        return replica_id

    def _hold(self, replica_id: str, replica: StateReplica, index: int) -> None:
        """Start held sequence ``index`` of ``replica`` (its next one when it ends)."""
        top = self.config.max_model_len - HELD_PROMPT_TOKENS
        # spread over [top/2, top] so that the held sequences end at different steps
        max_tokens = top - (index * 7919) % (top // 2 + 1)
        request_id = f"held-{index}-{next(self._held_ids)}"

        def on_tokens(_: int, finished: bool) -> None:
            if finished and self._served.get(replica_id) is not None:
                self._hold(replica_id, replica, index)

        replica.submit(request_id, HELD_PROMPT_TOKENS, max_tokens, on_tokens, self._clock())
        self._woken.add(replica_id)

    async def remove_replica(self, replica_id: str) -> None:
        """Stop serving ``replica_id`` (its connections closed, its port refused)."""
        served = self._served.pop(replica_id, None)
        if served is None:
            raise ValueError(f"no replica {replica_id!r} in the fleet")
        await served.server.stop(force=lambda: True)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for replica_id in list(self._served):
            await self.remove_replica(replica_id)

    async def _tick(self) -> None:
        while True:
            self.advance(self._clock())
            await asyncio.sleep(self.config.tick_s)

    def advance(self, now_s: float) -> None:
        """Advance, to ``now_s``, every replica whose step in flight has ended and every one
        given a request since the last call (the others have nothing to apply)."""
        due, self._woken = self._woken, set()
        while self._due and self._due[0][0] <= now_s:
            due.add(heapq.heappop(self._due)[2])
        for replica_id in due:
            served = self._served.get(replica_id)
            if served is None:  # removed meanwhile
                continue
            served.replica.advance_to(now_s)
            end_s = served.replica.step_end_s
            if end_s is not None:
                heapq.heappush(self._due, (end_s, next(self._pushes), replica_id))


class _ReplicaApp:
    """The ASGI face of one state-only replica."""

    def __init__(self, replica: StateReplica, clock: Callable[[], float],
                 wake: Callable[[], None], stream_phase: float = 0.0) -> None:
        self.replica = replica
        self.stream_phase = stream_phase  # serving.state_delta.serve_state_stream's phase
        self.clock = clock
        self._wake = wake  # the fleet advances this replica at its next tick
        self.created_s = int(time.time())
        self._ids = itertools.count()
        self.step_time_fit = StepTimeFit()  # one fit of itself for all its state streams

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await _send_json(send, {"ok": True})
        elif method == "GET" and path == "/v1/models":
            await _send_json(send, {"object": "list", "data": [
                {"id": self.replica.model, "object": "model", "created": self.created_s,
                 "owned_by": "kvguard", "max_model_len": self.replica.max_model_len}]})
        elif method == "GET" and path == "/kvguard/state/stream":
            await serve_state_stream(scope, receive, send, self._compact,
                                     phase=self.stream_phase, fit=self.step_time_fit)
        elif method == "GET" and path == "/kvguard/state":
            await self._state(scope, send)
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
        else:
            await _send_json(send, {"error": {"message": f"no route {method} {path}"}}, 404)

    def _compact(self) -> dict:
        state = self.replica.state()
        state.update(admitting=True, num_in_flight=len(self.replica.running)
                     + len(self.replica.waiting))
        return compact_state(state)

    async def _state(self, scope, send) -> None:
        query = dict(pair.split("=", 1) for pair in scope["query_string"].decode().split("&")
                     if "=" in pair)
        state = self.replica.state()
        state.update(admitting=True, num_in_flight=len(self.replica.running)
                     + len(self.replica.waiting))
        if query.get("compact") == "1":
            try:
                since = int(query["since_batch"]) if "since_batch" in query else None
            except ValueError:
                await _send_json(send, {"error": {"message": "since_batch: an integer"}}, 400)
                return
            state = compact_state(state, since)
        await _send_json(send, state)

    async def _generate(self, scope, receive, send, chat: bool) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            request = loads(body)  # orjson: a 4,000-token prompt is a 28 KB list
            num_prompt = _num_prompt_tokens(request, chat)
            max_tokens = int(request.get("max_tokens") or 16)
            stream = bool(request.get("stream"))
        except (ValueError, TypeError, AttributeError) as exc:
            await _send_json(send, {"error": {"message": f"bad request: {exc}"}}, 400)
            return
        headers = dict(scope["headers"])
        request_id = (headers.get(b"x-request-id") or f"s{next(self._ids)}".encode()).decode()
        tokens: asyncio.Queue = asyncio.Queue()
        try:
            self.replica.submit(request_id, num_prompt, max_tokens,
                                lambda n, done: tokens.put_nowait((n, done)), self.clock())
        except ValueError as exc:
            await _send_json(send, {"error": {"message": str(exc)}}, 400)
            return
        self._wake()
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        watcher.add_done_callback(lambda _: (self.replica.abort(request_id),
                                             tokens.put_nowait((0, True))))
        try:
            if stream:
                await self._stream(send, tokens, request_id, chat, num_prompt, max_tokens,
                                   request.get("stream_options") or {})
            else:
                done = False
                while not done:
                    _, done = await tokens.get()
                if not watcher.done():
                    await _send_json(send, _completion(request_id, chat, num_prompt,
                                                       max_tokens))
        finally:
            watcher.cancel()
            self.replica.abort(request_id)  # a no-op once it ended; frees it if the client left

    async def _stream(self, send, tokens, request_id, chat, num_prompt, max_tokens,
                      options) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"x-request-id", request_id.encode())]})
        done = False
        chunk = _chunk(request_id, chat, None)  # every token's event is the same bytes
        while not done:
            n, done = await tokens.get()
            if not n:  # the client left: the sequence is aborted, nothing more to send
                return
            body = chunk * (n - 1) + (_chunk(request_id, chat, "length") if done else chunk)
            await send({"type": "http.response.body", "more_body": True, "body": body})
        tail = b""
        if options.get("include_usage"):
            tail += b"data: " + json.dumps({"id": request_id, "choices": [], "usage": _usage(
                num_prompt, max_tokens)}).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})


async def _until_disconnect(receive) -> None:
    """Returns when the client disconnects (the engine aborts the sequence within a step)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _num_prompt_tokens(request: dict, chat: bool) -> int:
    if chat:
        messages = request["messages"]
        return max(1, sum(len(str(m.get("content", ""))) // 4 + 4 for m in messages))
    prompt = request["prompt"]
    if isinstance(prompt, list):
        return max(1, len(prompt))
    return max(1, len(str(prompt)) // 4)


def _usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output}


def _chunk(request_id: str, chat: bool, finish_reason: str | None) -> bytes:
    choice = ({"index": 0, "delta": {"content": " x"}, "finish_reason": finish_reason} if chat
              else {"index": 0, "text": " x", "finish_reason": finish_reason})
    obj = "chat.completion.chunk" if chat else "text_completion"
    return b"data: " + json.dumps({"id": request_id, "object": obj,
                                   "choices": [choice]}).encode() + b"\n\n"


def _completion(request_id: str, chat: bool, num_prompt: int, max_tokens: int) -> dict:
    text = " x" * max_tokens
    choice = ({"index": 0, "message": {"role": "assistant", "content": text},
               "finish_reason": "length"} if chat
              else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "choices": [choice], "usage": _usage(num_prompt, max_tokens)}


async def _send_json(send, payload: dict, status: int = 200) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
