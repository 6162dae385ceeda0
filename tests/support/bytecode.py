"""Where the suite's processes keep their bytecode (``tests/conftest.py`` applies it at start-up).

Where the environment says not to write bytecode (``PYTHONDONTWRITEBYTECODE``, as a container
that keeps its source tree clean may), every process the suite starts — several hundred
``kvguard proxy``, ``kvguard engine`` and ``kvguard epp`` processes and CLIs — compiled each
kvguard module it imported from source (~0.1 s of CPU per proxy start), and each xdist worker
redid pytest's assertion rewriting of every test file. The suite then writes its bytecode under
a prefix in the temp dir instead (``PYTHONPYCACHEPREFIX``): the source tree stays clean, and the
processes it starts inherit the prefix and read what an earlier one compiled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["pycache_prefix"]


def pycache_prefix(environ: Mapping[str, str], tmpdir: str) -> str | None:
    """The bytecode prefix the suite should use, or None to leave the environment as it is
    (bytecode is written as usual, or the environment already names a prefix)."""
    if not environ.get("PYTHONDONTWRITEBYTECODE") or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    return os.path.join(tmpdir, f"kvguard-pytest-pycache-{os.getuid()}")
