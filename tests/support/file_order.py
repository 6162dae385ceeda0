"""The order in which the suite's test files are handed to the xdist workers (``--dist loadfile``
hands out whole files, in this order, to whichever worker runs low first).

1. The files with ``exclusive`` tests (the chaos quick runs), most tests first. Nothing runs
   beside them, so the other worker is idle while they run wherever they come; first, they are
   over before anything else has started and, being the longest, never end the run late.
2. The files with ``cpu_heavy`` tests (``smollm2`` ones count), each followed by its share of the
   files with other ``slow`` tests. Two heavy tests never run at once; handed out back to back,
   two heavy files land on both workers together and one worker waits on the lock for each
   heavy test the other runs. Spread among the slow files, while one worker runs a heavy
   file the other has slow, light work.
3. Everything else (the many fast files), which fills in at the end.

Within each group the files keep their natural (collection) order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FileMarks", "file_order"]


@dataclass(frozen=True)
class FileMarks:
    """What a file's tests carry: how many tests, and whether any is exclusive, heavy, slow."""

    num_tests: int
    exclusive: bool = False
    heavy: bool = False
    slow: bool = False


def file_order(files: Mapping[str, FileMarks]) -> list[str]:
    """Every file of ``files`` (in their natural order) once, in the order described above."""
    exclusive = sorted((f for f, m in files.items() if m.exclusive),
                       key=lambda f: -files[f].num_tests)  # sorted() keeps ties in order
    heavy = [f for f, m in files.items() if m.heavy and not m.exclusive]
    slow = [f for f, m in files.items() if m.slow and not m.heavy and not m.exclusive]
    per_heavy = max(1, len(slow) // max(1, len(heavy)))
    spread: list[str] = []
    for i, f in enumerate(heavy):
        spread += [f, *slow[i * per_heavy:(i + 1) * per_heavy]]
    spread += slow[len(heavy) * per_heavy:]
    first = exclusive + spread
    placed = set(first)
    return first + [f for f in files if f not in placed]

