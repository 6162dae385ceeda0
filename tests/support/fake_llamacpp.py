"""A stand-in for a llama.cpp-family OpenAI server, so CI never compiles llama.cpp.

Two behaviours of the real servers, as their sources describe them:

* ``interrupt=True`` is llama-cpp-python's ``llama_cpp.server`` (one model, one slot): a
  request that arrives while another streams takes the model's outer lock; the running stream
  sees that lock held before its next token, sends ``data: [DONE]`` with no ``finish_reason``
  and stops (``interrupt_requests``, on by default); the newcomer then runs. With several
  waiting, each new stream is cut the same way while anyone waits behind it.
* ``interrupt=False`` is llama.cpp's own ``llama-server --parallel N``: ``num_slots`` requests
  run at once, the rest wait (``requests_deferred``) until a slot frees; nothing is cut.

Like llama-cpp-python it refuses an ``x-request-id`` that is not a UUID (400), and publishes
neither ``/metrics`` nor ``/kvguard/state`` (404): a replica that shows nothing. Each request
spends ``prefill_s`` before its first token and ``token_s`` per token after it, up to its
``max_tokens``; the last chunk carries ``finish_reason: "length"``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["FakeLlamaCpp"]


class FakeLlamaCpp:
    """The server's state (slots, waiters, counts); :attr:`app` is its ASGI app."""

    def __init__(self, *, num_slots: int = 1, interrupt: bool = True, prefill_s: float = 0.05,
                 token_s: float = 0.03, model: str = "smollm2-fake") -> None:
        if num_slots < 1:
            raise ValueError("num_slots: must be >= 1")
        self.num_slots = num_slots
        self.interrupt = interrupt
        self.prefill_s = prefill_s
        self.token_s = token_s
        self.model = model
        self._slots: asyncio.Semaphore | None = None  # made on the server's own loop
        self.num_waiting = 0
        self.num_interrupted = 0
        self.num_finished = 0
        self.bad_request_ids: list[str] = []
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models),
            Route("/health", self._health),
        ])

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        request_id = request.headers.get("x-request-id")
        if request_id is not None:
            try:
                uuid.UUID(request_id)
            except ValueError:
                self.bad_request_ids.append(request_id)
                return JSONResponse({"detail": "x-request-id is not a valid UUID"},
                                    status_code=400)
        body = await request.json()
        max_tokens = int(body.get("max_tokens") or 16)
        return StreamingResponse(self._stream(max_tokens), media_type="text/event-stream")

    async def _stream(self, max_tokens: int):
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.num_slots)
        self.num_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_waiting -= 1
        try:
            await asyncio.sleep(self.prefill_s)
            for i in range(max_tokens):
                if self.interrupt and self.num_waiting:
                    self.num_interrupted += 1
                    yield b"data: [DONE]\n\n"  # cut: no finish_reason
                    return
                last = i == max_tokens - 1
                yield _chunk(f" t{i}", "length" if last else None)
                if not last:
                    await asyncio.sleep(self.token_s)
            self.num_finished += 1
            yield b"data: [DONE]\n\n"
        finally:
            self._slots.release()


def _chunk(text: str, finish_reason: str | None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    event = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
             "model": "smollm2-fake", "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"
