"""One child process that listens on a loopback port, started, signalled and ended by its pid.

:class:`ChildProcess` is the unit :mod:`chaos.topology` builds fleets from. It starts a command,
learns its URL (from a readiness line the child prints, or from a port chosen up front), waits
until the child answers its health check, and offers the signals fault injection needs:

    child.kill()      # SIGKILL: the process dies at once, its connections reset
    child.stop()      # SIGSTOP: the process hangs (sockets stay open, nothing answers)
    child.cont()      # SIGCONT: a stopped process runs again
    child.restart()   # start it again on the same port (after kill, or kill it first)
    child.terminate() # SIGTERM (graceful), SIGKILL after a timeout
    child.close()     # terminate for good: what teardown calls; a start after it (or racing
                      # it, e.g. a fault's restart in a worker thread during Ctrl-C) is refused
                      # or ended, so no restarted child outlives its fleet

Signals go to this one pid, never to a process group or by name. The child's combined
stdout/stderr is kept (the last ``max_output_lines`` lines) for error messages.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["ChildProcess", "HealthCheck"]

# health(url) -> True when the child is ready to serve; it must not raise.
HealthCheck = Callable[[str], bool]


class ChildProcess:
    """A command on a loopback port. ``argv_for(port)`` builds the command line for a port
    (0 lets the child choose, in which case ``ready_pattern`` must capture its URL)."""

    def __init__(self, name: str, argv_for: Callable[[int], Sequence[str]], health: HealthCheck,
                 *, ready_pattern: str | None = None, port: int = 0,
                 env: dict[str, str] | None = None, max_output_lines: int = 400,
                 niceness: int = 0, cpus: Sequence[int] = ()) -> None:
        if port == 0 and ready_pattern is None:
            raise ValueError(f"{name}: port 0 needs a ready_pattern that captures the URL")
        if isinstance(niceness, bool) or not isinstance(niceness, int) or not 0 <= niceness <= 19:
            raise ValueError(f"{name}: niceness must be an integer in [0, 19], got {niceness!r}")
        if any(isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0 for cpu in cpus):
            raise ValueError(f"{name}: cpus must be CPU numbers (integers >= 0), got {cpus!r}")
        self.name = name
        self._argv_for = argv_for
        self.niceness = niceness  # > 0: started under `nice -n` (the same pid after its exec)
        # non-empty: started under `taskset -c` (the same pid after its exec), so that every
        # thread it ever starts runs on these CPUs only
        self.cpus = tuple(sorted(set(cpus)))
        self._health = health
        self._ready = re.compile(ready_pattern) if ready_pattern else None
        self.port = port
        self.url = f"http://127.0.0.1:{port}" if port else ""
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._lines: collections.deque[str] = collections.deque(maxlen=max_output_lines)
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0
        self._lock = threading.Lock()   # orders a start's Popen against close()
        self._closed = False
        self._pump_thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> ChildProcess:
        """Start the child and wait until it is healthy (RuntimeError with its output if not)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} was closed (its fleet is being torn down)")
            if self.alive:
                raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
            argv = list(self._argv_for(self.port))
            if self.niceness:
                argv = ["nice", "-n", str(self.niceness), *argv]
            if self.cpus:
                argv = ["taskset", "-c", ",".join(map(str, self.cpus)), *argv]
            self.proc = subprocess.Popen(argv,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=self._env)
            self.num_starts += 1
        ready = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, args=(self.proc, ready),
                                             daemon=True, name=f"{self.name}-output")
        self._pump_thread.start()
        deadline_s = time.monotonic() + timeout_s
        if self._ready is not None and (not ready.wait(timeout_s) or not self.url):
            self._fail(f"did not print its readiness line within {timeout_s:.0f} s")
        while time.monotonic() < deadline_s:
            if self._health(self.url):
                return self
            if self._closed:
                raise RuntimeError(f"{self.name} was closed while starting")
            if self.proc.poll() is not None:
                self._fail(f"exited with code {self.proc.returncode} before it was healthy")
            time.sleep(0.05)
        self._fail(f"was not healthy within {timeout_s:.0f} s")
        return self  # unreachable: _fail raises

    def _fail(self, why: str) -> None:
        self.terminate()
        if self._pump_thread is not None:  # the process is gone: its last lines are in the pipe
            self._pump_thread.join(5.0)
        raise RuntimeError(f"{self.name} {why}:\n{self.output()[-3000:]}")

    def _pump(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line)
            if self._ready is not None and not ready.is_set():
                match = self._ready.search(line)
                if match:
                    self.url = match.group(1).rstrip("/")
                    self.port = int(self.url.rsplit(":", 1)[1])
                    ready.set()
        ready.set()  # the process ended: wake the waiter

    def restart(self, timeout_s: float = 90.0) -> ChildProcess:
        """Start again on the same port (the URL stays valid); SIGKILLs a live child first."""
        if self.alive:
            self.kill()
        if self.proc is not None:
            self.proc.wait(timeout_s)
        return self.start(timeout_s)

    def close(self, timeout_s: float = 15.0) -> int | None:
        """Terminate for good: no start may follow, and one under way in another thread is
        refused (before its Popen) or sees its new process ended here (after it)."""
        with self._lock:
            self._closed = True
        return self.terminate(timeout_s)

    def terminate(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (and SIGCONT, in case it is stopped), wait, then SIGKILL. The exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a stopped child would never see SIGTERM
            try:
                return proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait(timeout_s)

    # --- fault injection -----------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL this pid and reap it."""
        self._signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGSTOP: the process hangs with its sockets open."""
        self._signal(signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT: a stopped process runs again."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        if not self.alive:
            raise RuntimeError(f"{self.name} is not running")
        assert self.proc is not None
        os.kill(self.proc.pid, signum)

    # --- facts --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def output(self) -> str:
        return "".join(self._lines)

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, url={self.url!r}, pid={self.pid}, alive={self.alive})"
