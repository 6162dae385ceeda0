"""``kvguard fleet ARGS`` as a child process for tests: started, its per-process lines read up to
``fleet ready``, and killed by its pid on the way out if the test left it running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["fleet_cli"]


@contextmanager
def fleet_cli(*args: str, ready_timeout_s: float = 120.0
              ) -> Iterator[tuple[subprocess.Popen, list[list[str]]]]:
    """Yields ``(proc, lines)``: each line the fleet printed before ``fleet ready``, split
    (name, url, …, pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "guard.cli", "fleet", *args],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        deadline_s = time.monotonic() + ready_timeout_s  # hang guard
        while time.monotonic() < deadline_s:
            line = proc.stdout.readline()
            if not line or line.startswith("fleet ready"):
                break
            lines.append(line.split())
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
