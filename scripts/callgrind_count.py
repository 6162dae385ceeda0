"""Instructions counted by valgrind's callgrind for one Python program, shared by the
``*_instructions.py`` scripts (run as ``python scripts/NAME.py``, so this directory is on the
import path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

__all__ = ["callgrind_instructions"]


def callgrind_instructions(root: str, program: str, args: list[str], out_file: str,
                           env: dict[str, str] | None = None) -> int:
    """``python -c PROGRAM ARGS`` under callgrind in checkout ``root`` (on ``PYTHONPATH``, a
    fixed hash seed); the instructions it collected."""
    env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": "0", **(env or {})}
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
         sys.executable, "-c", program, *args],
        cwd=root, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run in {root} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1))
