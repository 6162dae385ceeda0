"""A guard process for the multi-guard budget tests: a small completion app wrapped in
AdmissionMiddleware (config from ``KVGUARD_CONFIG``), served by uvicorn on 127.0.0.1:PORT.

Each completion of a tenant (a request with an ``authorization`` header) holds for ``HOLD_S``
seconds, or until the process gets SIGUSR1 (which ends every hold under way), so the test has many
requests in flight at once for as long as it needs them; an anonymous completion (the test's
warm-up, which only starts the guard's store) answers at once. Every completion reports ``usage``
of 10 prompt + 5 completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys

import uvicorn

from guard.middleware import AdmissionMiddleware

USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


class _Holds:
    """The event the holds under way wait on; SIGUSR1 sets it and starts a new one."""

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None

    def current(self) -> asyncio.Event:
        if self.release is None:  # first use: inside the server's event loop
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._release_all)
            self.release = asyncio.Event()
        return self.release

    def _release_all(self) -> None:
        assert self.release is not None
        self.release.set()
        self.release = asyncio.Event()


def completion_app(hold_s: float):
    holds = _Holds()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":  # no /kvguard/state: a replica of unknown capacity
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if any(name == b"authorization" for name, _ in scope["headers"]):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(holds.current().wait(), hold_s)
        body = json.dumps({"id": "c", "object": "text_completion", "model": "m",
                           "choices": [{"index": 0, "text": " hi", "finish_reason": "stop"}],
                           "usage": USAGE}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


if __name__ == "__main__":
    port, hold_s = int(sys.argv[1]), float(sys.argv[2])
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until a hold is under way: nothing to end
    uvicorn.run(AdmissionMiddleware(completion_app(hold_s)), host="127.0.0.1", port=port,
                log_level="warning", lifespan="off")
