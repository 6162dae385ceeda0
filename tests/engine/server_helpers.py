"""Start ``kvguard engine`` as a subprocess on a free loopback port, for tests.

    with start_engine(["--model", "tiny", "--device", "cpu"]) as eng:
        httpx.get(eng.base_url + "/health")

The server is started with ``--port 0``; the helper waits for its readiness line
(``kvguard engine listening on http://HOST:PORT``), then for ``/health`` to answer 200. At exit it
sends SIGTERM to that one pid, waits, and SIGKILLs it if it is still alive. ``eng.output()``
returns what the process printed so far (stdout and stderr), for assertion messages.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

__all__ = ["EngineProcess", "HELPERS_DIR", "StampMiddleware", "start_engine", "wait_until"]

_READY = re.compile(r"kvguard engine listening on (http://\S+)")
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


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    base_url: str = ""
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout_s)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned) or time runs out (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(interval_s)


def _pump(eng: EngineProcess, ready: threading.Event) -> None:
    for line in eng.proc.stdout:
        eng.lines.append(line)
        match = _READY.search(line)
        if match and not eng.base_url:
            eng.base_url = match.group(1)
            ready.set()
    ready.set()  # the process exited


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def start_engine(args: Sequence[str], *, timeout_s: float = 90.0,
                 env: dict[str, str] | None = None) -> Iterator[EngineProcess]:
    """Run ``kvguard engine ARGS --host 127.0.0.1 --port 0`` until the block exits."""
    cmd = [sys.executable, "-m", "guard.cli", "engine", *args, "--host", "127.0.0.1",
           "--port", "0"]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=_REPO_ROOT)
    eng = EngineProcess(proc)
    ready = threading.Event()
    threading.Thread(target=_pump, args=(eng, ready), daemon=True).start()
    try:
        ready.wait(timeout_s)
        if not eng.base_url:
            raise RuntimeError(f"kvguard engine did not start: {eng.output()[-3000:]}")
        if not wait_until(lambda: _healthy(eng.base_url), timeout_s=30.0):
            raise RuntimeError(f"kvguard engine never became healthy: {eng.output()[-3000:]}")
        yield eng
    finally:
        eng.stop()
