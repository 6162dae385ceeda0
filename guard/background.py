"""Stopping the guard's background loops (pollers, probes, heartbeats, list watchers)."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait until it has ended; its cancellation is
    not re-raised here (the caller asked for it), anything else it raised is."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
