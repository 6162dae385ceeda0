"""Start ``kvguard engine`` as a subprocess on a free loopback port, for tests.

    with start_engine(["--model", "tiny", "--device", "cpu"]) as eng:
        httpx.get(eng.base_url + "/health")

The server is started with ``--port 0``; the helper waits for its readiness line
(``kvguard engine listening on http://HOST:PORT``), then for ``/health`` to answer 200. At exit it
sends SIGTERM to that one pid, waits, and SIGKILLs it if it is still alive. ``eng.output()``
returns what the process printed so far (stdout and stderr), for assertion messages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from chaos.replica import ReplicaProcess

__all__ = ["EngineProcess", "HELPERS_DIR", "StampMiddleware", "start_engine", "wait_until"]

HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(os.path.dirname(HELPERS_DIR))


class StampMiddleware:
    """A pass-through ASGI middleware that stamps ``x-stamped: 1`` on every response; loaded
    by a test through ``--middleware server_helpers:StampMiddleware``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def stamped(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"x-stamped", b"1")])
            await send(message)

        await self.app(scope, receive, stamped if scope["type"] == "http" else send)


EngineProcess = ReplicaProcess  # .proc, .base_url, .output(), .stop()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned) or time runs out (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(interval_s)


def start_engine(args: Sequence[str], *, timeout_s: float = 90.0,
                 env: dict[str, str] | None = None):
    """Run ``kvguard engine ARGS --host 127.0.0.1 --port 0`` until the block exits (the
    chaos suite's own replica launcher, run from the repo root)."""
    return ReplicaProcess.start(args, env=env, timeout_s=timeout_s, cwd=_REPO_ROOT)
