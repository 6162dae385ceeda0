"""Live progress of a load run: a rich line on a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import TextIO

from chaos.load import LiveCounts

__all__ = ["progress", "describe"]

PLAIN_EVERY_S = 3.0  # without a terminal: one plain line this often


def describe(counts: LiveCounts, elapsed_s: float) -> str:
    o = counts.by_outcome
    return (f"{elapsed_s:6.1f}s sent {counts.num_sent}/{counts.num_planned} "
            f"in-flight {counts.num_in_flight} completed {o['completed']} "
            f"rejected {o['rejected']} failed {o['failed']} canceled {o['canceled']}")


@contextmanager
def progress(stream: TextIO = sys.stderr, is_tty: bool | None = None, quiet: bool = False):
    """Yield an ``on_tick(counts, elapsed_s)`` callback for ``run_load`` (None when quiet)."""
    if quiet:
        yield None
        return
    tty = stream.isatty() if is_tty is None else is_tty
    if tty:
        from rich.console import Console
        from rich.live import Live
        with Live("", console=Console(file=stream), refresh_per_second=4) as live:
            yield lambda counts, t: live.update(describe(counts, t))
        return
    yield _plain(stream)


def _plain(stream: TextIO) -> Callable[[LiveCounts, float], None]:
    last = {"t": -PLAIN_EVERY_S}

    def on_tick(counts: LiveCounts, elapsed_s: float) -> None:
        if elapsed_s - last["t"] >= PLAIN_EVERY_S:
            last["t"] = elapsed_s
            print(describe(counts, elapsed_s), file=stream, flush=True)
    return on_tick
