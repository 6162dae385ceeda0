"""The OpenAI-compatible HTTP surface of one engine replica (Starlette).

``build_app(async_engine, model_name, tokenizer, metrics, trace=None)`` serves
``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``,
``GET /health``, ``GET /kvguard/state`` and ``GET /metrics``. A generation body is read up to
``max_body_bytes`` (413 ``body_too_large`` beyond, before buffering the rest).

Every generation request ends in exactly one of: rejected (4xx/503 before the engine saw it),
completed (``stop``/``length``), aborted (the client went away, or shutdown), failed (engine
error). A client that disconnects — mid-stream or while waiting for a non-streamed answer — has
its sequence aborted at once, so its KV blocks are free after the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineShutdownError,
    EngineStepError,
    RequestStream,
)
from engine.compact_state import compact_state
from engine.metrics import EngineMetrics
from engine.openai_request import ApiError, GenerationRequest, parse_generation_request
from engine.text_stream import TextStream
from engine.trace import RequestTimeline, TraceWriter
from serving.state_delta import serve_state_stream
from serving.step_time_fit import StepTimeFit

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]

DEFAULT_MAX_BODY_BYTES = 1 << 20  # the guard's max_body_bytes default

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def _json(payload: dict, status: int = 200, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(payload, status_code=status, headers=headers)


class _Outcome:
    """How one admitted request ended; recorded exactly once by ``_Replica._finish``."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None  # stop | length | abort | error
        self.num_output_tokens = 0
        self.num_cached_tokens = 0


class _Replica:
    """The handlers and their dependencies (one per app)."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, tokenizer,
                 metrics: EngineMetrics, trace: TraceWriter | None,
                 clock: Callable[[], float], max_body_bytes: int) -> None:
        self.engine = async_engine
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.trace = trace
        self.clock = clock
        state = async_engine.state()
        self.max_model_len = int(state["max_model_len"])
        self.max_pool_tokens = int(state["num_total_blocks"]) * int(state["block_size"])
        metrics.set_cache_config(state["block_size"], state["num_total_blocks"],
                                 bool(state.get("enable_prefix_caching", False)))
        self.created_s = int(time.time())
        self.step_time_fit = StepTimeFit()  # one fit of itself for all its state streams

    # ---- plain endpoints -------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created_s,
                "owned_by": "kvguard", "max_model_len": self.max_model_len}
        return _json({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        self.engine.start()
        health = self.engine.health()
        return _json(health, 200 if health["ok"] else 503)

    async def state(self, request: Request) -> Response:
        self.engine.start()
        state = dict(self.engine.state())
        state.update(model=self.model_name, admitting=self.engine.admitting,
                     num_in_flight=self.engine.num_in_flight)
        query = request.query_params
        if query.get("compact") == "1":  # columns, and only the iterations not seen yet
            since = query.get("since_batch")
            try:
                since_batch = int(since) if since is not None else None
            except ValueError:
                return _json({"error": {"message": f"since_batch: an integer, got {since!r}",
                                        "type": "invalid_request_error"}}, 400)
            state = compact_state(state, since_batch)
        return _json(state)

    def compact_state(self) -> dict:
        """The compact ``/kvguard/state`` of now, every kept iteration sample included."""
        state = dict(self.engine.state())
        state.update(model=self.model_name, admitting=self.engine.admitting,
                     num_in_flight=self.engine.num_in_flight)
        return compact_state(state)

    async def state_stream(self, scope, receive, send) -> None:
        """``GET /kvguard/state/stream``: :mod:`serving.state_delta`'s events."""
        self.engine.start()
        await serve_state_stream(scope, receive, send, self.compact_state,
                                 lambda: self.engine.admitting, fit=self.step_time_fit)

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.observe_state(self.engine.state())
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        self.engine.start()
        arrival_s = self.clock()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        self.metrics.record_received()
        try:
            gen = parse_generation_request(await _read_body(request, self.max_body_bytes),
                                           chat=chat,
                                           model_name=self.model_name, tokenizer=self.tokenizer,
                                           max_model_len=self.max_model_len,
                                           max_pool_tokens=self.max_pool_tokens)
            tokens = [] if self.trace is not None and gen.stream else None
            timeline = RequestTimeline(request_id, arrival_s=arrival_s, stream=gen.stream,
                                       tokens=tokens)
            stream = await self.engine.add_request(request_id, list(gen.prompt_token_ids),
                                                   gen.params, priority=gen.priority,
                                                   timeline=timeline,
                                                   cache_salt=gen.cache_salt)
        except ApiError as err:
            return self._reject(err, request_id)
        except ClientDisconnect:  # gone while sending its body: canceled, never admitted
            self.metrics.record_aborted()
            return Response(status_code=499)
        except DuplicateRequestError as exc:
            return self._reject(ApiError(409, str(exc), code="duplicate_request_id"), request_id)
        except EngineShutdownError as exc:
            return self._reject(ApiError(503, str(exc), type="server_error",
                                         code="shutting_down"), request_id)
        except ValueError as exc:
            return self._reject(ApiError(400, str(exc)), request_id)
        if gen.stream:
            return _SSEResponse(self, gen, stream)
        return await self._complete(request, gen, stream)

    def _reject(self, err: ApiError, request_id: str) -> Response:
        self.metrics.record_rejected(err.status)
        return _json(_error_body(err), err.status, request_id)

    async def _complete(self, request: Request, gen: GenerationRequest,
                        stream: RequestStream) -> Response:
        outcome = _Outcome()
        pieces: list[str] = []
        collect = asyncio.ensure_future(self._collect(gen, stream, pieces, outcome))
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                collect.result()
        except Exception as exc:  # EngineStepError, or a bug on our side: fail this request
            outcome.finish_reason = "error"
            err = ApiError(500, str(exc), type="server_error", code="engine_error")
            return _json(_error_body(err), 500, stream.request_id)
        finally:
            for task in (collect, gone):
                task.cancel()
            self._finish(gen, stream, outcome)
        if outcome.finish_reason is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        body = _response_body(self, gen, stream.request_id, "".join(pieces), outcome)
        return _json(body, 200, stream.request_id)

    async def _collect(self, gen: GenerationRequest, stream: RequestStream, pieces: list[str],
                       outcome: _Outcome) -> None:
        async for piece in self.deltas(gen, stream, outcome):
            pieces.append(piece.text)

    async def deltas(self, gen: GenerationRequest, stream: RequestStream,
                     outcome: _Outcome) -> AsyncIterator:
        """Text pieces of one request; sets ``outcome`` when the request finished."""
        text = TextStream(self.tokenizer, gen.stop)
        timeline = stream.timeline  # per-token records only while tracing a stream
        async for out in stream:
            if timeline.tokens is not None:
                timeline.token_handed(out, self.clock())
            piece = text.push(out.new_token_ids, out.finished)
            outcome.num_output_tokens = out.num_output_tokens
            outcome.num_cached_tokens = out.num_cached_tokens
            if piece.finish_reason is None and out.finished:
                piece = piece.with_finish_reason(out.finish_reason)
            if piece.finish_reason is not None:
                outcome.finish_reason = piece.finish_reason
            yield piece
            if piece.finish_reason is not None:
                return

    def _finish(self, gen: GenerationRequest, stream: RequestStream, outcome: _Outcome) -> None:
        """Record the end of one admitted request (exactly once)."""
        stream.abort()  # no-op when the engine already finished it
        timeline = stream.timeline
        timeline.completion_s = self.clock()
        reason = outcome.finish_reason or "abort"
        timeline.finish_reason = reason
        timeline.num_output_tokens = outcome.num_output_tokens
        if reason in ("stop", "length"):
            ttft_s = (None if timeline.first_token_s is None
                      else timeline.first_token_s - timeline.arrival_s)
            self.metrics.record_finished(
                reason, ttft_s=ttft_s, e2e_s=timeline.completion_s - timeline.arrival_s,
                queue_s=timeline.queue_s, num_output_tokens=outcome.num_output_tokens)
        elif reason == "error":
            self.metrics.record_failed()
        else:
            self.metrics.record_aborted()
        if self.trace is not None:
            self.trace.write(timeline)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it would pass ``max_bytes`` (a declared
    Content-Length over the limit is refused before anything is read)."""
    too_large = ApiError(413, f"The request body exceeds {max_bytes} bytes.",
                         code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _usage(gen: GenerationRequest, outcome: _Outcome) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    the prefix cache supplied."""
    num_prompt, num_output = len(gen.prompt_token_ids), outcome.num_output_tokens
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": outcome.num_cached_tokens}}


def _response_body(replica: _Replica, gen: GenerationRequest, request_id: str, text: str,
                   outcome: _Outcome) -> dict:
    created = int(time.time())
    if gen.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": outcome.finish_reason}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": outcome.finish_reason}
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + request_id, "object": kind, "created": created,
            "model": replica.model_name, "choices": [choice],
            "usage": _usage(gen, outcome)}


class _ChunkFormatter:
    """Builds the SSE ``data:`` payloads of one streamed response.

    The per-token chunk is the hot path (one per token per stream), so its JSON is assembled
    from a pre-encoded head plus the few fields that change.
    """

    def __init__(self, replica: _Replica, gen: GenerationRequest, request_id: str) -> None:
        self.gen = gen
        self.head = {"id": ("chatcmpl-" if gen.chat else "cmpl-") + request_id,
                     "object": "chat.completion.chunk" if gen.chat else "text_completion",
                     "created": int(time.time()), "model": replica.model_name}
        self._prefix = ("data: " + json.dumps(self.head, separators=(",", ":"))[:-1]
                        + ',"choices":[{"index":0,"logprobs":null,')
        self._suffix = '}],"usage":null}\n\n' if gen.include_usage else "}]}\n\n"

    def _event(self, choices: list, usage: dict | None = None) -> bytes:
        payload = dict(self.head, choices=choices)
        if self.gen.include_usage:
            payload["usage"] = usage
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def role(self) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self._event([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}])

    def piece(self, piece) -> bytes:
        reason = "null" if piece.finish_reason is None else json.dumps(piece.finish_reason)
        ids = ",".join(map(str, piece.token_ids))
        if not self.gen.chat:
            body = f'"text":{json.dumps(piece.text)}'
        elif piece.text or piece.finish_reason is None:
            body = f'"delta":{{"content":{json.dumps(piece.text)}}}'
        else:
            body = '"delta":{}'
        return (f'{self._prefix}{body},"finish_reason":{reason},"token_ids":[{ids}]'
                f'{self._suffix}').encode()

    def usage(self, outcome: _Outcome) -> bytes:
        return self._event([], _usage(self.gen, outcome))

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + json.dumps(_error_body(err)).encode() + b"\n\n"


class _SSEResponse(Response):
    """Streams one request as SSE while watching for the client's disconnect.

    Pure ASGI: the sender and a disconnect watcher race; whichever ends first cancels the
    other, and ``finally`` aborts the sequence if it had not finished (send failure included).
    """

    def __init__(self, replica: _Replica, gen: GenerationRequest, stream: RequestStream) -> None:
        self.status_code = 200
        self.background = None
        headers = dict(_SSE_HEADERS, **{"content-type": "text/event-stream; charset=utf-8",
                                        "x-request-id": stream.request_id})
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers.items()]
        self.replica, self.gen, self.stream = replica, gen, stream

    async def __call__(self, scope, receive, send) -> None:
        outcome = _Outcome()
        sender = asyncio.ensure_future(self._send_all(send, outcome))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
            if sender.done() and not sender.cancelled():
                exc = sender.exception()
                if exc is not None and not isinstance(exc, OSError):
                    outcome.finish_reason = outcome.finish_reason or "error"
                    raise exc
        finally:
            for task in (sender, gone):
                task.cancel()
            self.replica._finish(self.gen, self.stream, outcome)

    async def _send_all(self, send, outcome: _Outcome) -> None:
        fmt = _ChunkFormatter(self.replica, self.gen, self.stream.request_id)
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if self.gen.chat:
            await self._body(send, fmt.role())
        try:
            async for piece in self.replica.deltas(self.gen, self.stream, outcome):
                if self.replica.trace is not None and self.stream.timeline.first_byte_s is None:
                    self.stream.timeline.first_byte_s = self.replica.clock()
                await self._body(send, fmt.piece(piece))
                if self.stream.timeline.tokens is not None:
                    self.stream.timeline.token_written(self.replica.clock())
        except EngineStepError as exc:
            outcome.finish_reason = "error"
            await self._body(send, fmt.error(ApiError(500, str(exc), type="server_error",
                                                      code="engine_error")))
        else:
            if self.gen.include_usage:
                await self._body(send, fmt.usage(outcome))
        await self._body(send, b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _body(send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


def build_app(async_engine: AsyncEngine, model_name: str, tokenizer, metrics: EngineMetrics,
              trace: TraceWriter | None = None, *,
              clock: Callable[[], float] = time.monotonic,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The replica's ASGI app. The engine thread starts with the app (lifespan) or on the first
    request, whichever comes first. A generation body over ``max_body_bytes`` is a 413."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    replica = _Replica(async_engine, model_name, tokenizer, metrics, trace, clock,
                       max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield

    routes = [
        Route("/v1/completions", replica.completions, methods=["POST"]),
        Route("/v1/chat/completions", replica.chat_completions, methods=["POST"]),
        Route("/v1/models", replica.models, methods=["GET"]),
        Route("/health", replica.health, methods=["GET"]),
        Route("/kvguard/state", replica.state, methods=["GET"]),
        Route("/kvguard/state/stream", _AsgiEndpoint(replica.state_stream), methods=["GET"]),
        Route("/metrics", replica.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.replica = replica
    return app


class _AsgiEndpoint:
    """A coroutine ``(scope, receive, send)`` as a Starlette endpoint (it writes its own
    response: the state stream)."""

    def __init__(self, handler: Callable) -> None:
        self._handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self._handler(scope, receive, send)
