"""Quiet logging of writes to clients that went away: counted, one summary line at most per
interval.

When a client drops a streamed response, asyncio's socket transport logs
``socket.send() raised exception.`` for every write the server makes before it learns of the
disconnect (the ``asyncio`` logger, WARNING); hundreds of dropped streams flood the log with
thousands of identical lines. ``SendErrorLogFilter`` counts them instead and lets through one
line per ``interval_s``: ``N writes to disconnected clients in the last T s (M in all)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["SEND_ERROR_MESSAGE", "SendErrorLogFilter", "install_send_error_filter"]

SEND_ERROR_MESSAGE = "socket.send() raised exception."


class SendErrorLogFilter(logging.Filter):
    """Drops asyncio's per-write send errors; turns one per interval into a summary line."""

    def __init__(self, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.num_total = 0
        self._clock = clock
        self._num_since_line = 0
        self._last_line_s: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != SEND_ERROR_MESSAGE:
            return True
        self.num_total += 1
        self._num_since_line += 1
        now_s = self._clock()
        if self._last_line_s is not None and now_s - self._last_line_s < self.interval_s:
            return False
        window_s = self.interval_s if self._last_line_s is None else now_s - self._last_line_s
        record.msg = ("%d write(s) to disconnected clients in the last %.0f s (%d in all); "
                      "counted, not logged one by one")
        record.args = (self._num_since_line, window_s, self.num_total)
        record.exc_info = record.exc_text = None
        self._num_since_line = 0
        self._last_line_s = now_s
        return True


def install_send_error_filter(logger: logging.Logger | None = None, interval_s: float = 60.0,
                              clock: Callable[[], float] = time.monotonic) -> SendErrorLogFilter:
    """Attach a ``SendErrorLogFilter`` to ``logger`` (default: the ``asyncio`` logger)."""
    log_filter = SendErrorLogFilter(interval_s, clock)
    (logger or logging.getLogger("asyncio")).addFilter(log_filter)
    return log_filter
