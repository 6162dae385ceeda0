"""Start and stop ``kvguard engine`` replicas as child processes, on free loopback ports.

    with ReplicaProcess.start(["--model", "llama-7b", "--backend", "sim"]) as replica:
        run_load(url=replica.base_url, ...)

The child is started with ``--port 0`` and the helper waits for its readiness line
(``kvguard engine listening on http://HOST:PORT``) and a 200 from ``/health``. Stopping sends
SIGTERM to that one pid (never a process group), waits, and SIGKILLs it only if it is still
alive. The chaos suite ends only the processes it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from chaos.topology import http_health

__all__ = ["REPLICA_SERVERS", "ReplicaProcess", "write_guard_config", "exit_on_sigterm", "wait_idle"]

REPLICA_SERVERS: tuple[str, ...] = ("h11", "kvguard", "httptools", "auto")  # `kvguard engine --http`

_READY = re.compile(r"kvguard engine listening on (http://\S+)")


@dataclass
class ReplicaProcess:
    proc: subprocess.Popen
    base_url: str = ""
    lines: list[str] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def start(cls, args: Sequence[str], *, env: dict | None = None, timeout_s: float = 90.0,
              cwd: str | None = None) -> Iterator[ReplicaProcess]:
        """Run ``kvguard engine ARGS --host 127.0.0.1 --port 0`` until the block exits."""
        cmd = [sys.executable, "-m", "guard.cli", "engine", *args, "--host", "127.0.0.1",
               "--port", "0"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=cwd,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        replica = cls(proc)
        try:
            replica._wait_ready(timeout_s)
            yield replica
        finally:
            replica.stop()

    def output(self) -> str:
        return "".join(self.lines)

    def _wait_ready(self, timeout_s: float) -> None:
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        if not ready.wait(timeout_s) or not self.base_url:
            raise RuntimeError(f"kvguard engine did not start within {timeout_s:.0f} s:\n"
                               f"{self.output()[-2000:]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if http_health(self.base_url):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"kvguard engine never became healthy:\n{self.output()[-2000:]}")

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = _READY.search(line)
            if match and not ready.is_set():
                self.base_url = match.group(1).rstrip("/")
                ready.set()
        ready.set()  # the process ended: wake the waiter

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM this pid, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout_s)


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the engine at ``url`` has nothing running or waiting (RuntimeError past
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(url + "/kvguard/state", timeout=5.0, trust_env=False).json()
        if not state["running"] and not state["waiting"]:
            return
        time.sleep(0.2)
    raise RuntimeError(f"replica at {url} did not drain within {timeout_s:.0f} s")


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the replicas this process
    started (Python's default SIGTERM handling would end it without unwinding)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def write_guard_config(path: str, *, policy: str, ttft_s: float, itl_s: float,
                       policy_params: dict | None = None, trace_path: str | None = None,
                       extra_toml: str = "", settings: dict | None = None) -> str:
    """A minimal guard TOML: one ``interactive`` class with the given SLO and one policy;
    ``settings`` are more top-level keys; ``extra_toml`` (tables such as ``[[tenants]]``) is
    appended as given."""
    lines = [f'policy = "{policy}"', 'default_class = "interactive"',
             "anonymous_may_choose_class = true"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in (settings or {}).items()]
    if trace_path:
        lines.append(f'trace_path = "{trace_path}"')
    lines += ["", "[classes.interactive]", f"ttft_s = {ttft_s!r}", f"itl_s = {itl_s!r}",
              "priority = 0"]
    if policy_params:
        lines += ["", "[policy_params]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in policy_params.items()]
    if extra_toml:
        lines += ["", extra_toml.strip()]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
