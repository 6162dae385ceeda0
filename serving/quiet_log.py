"""Client-caused log lines counted, not logged one by one: one summary line per interval.

Two lines any client can make a server print as often as it likes:

* ``socket.send() raised exception.`` (the ``asyncio`` logger): once for every write the server
  makes to a client that dropped its stream, before the server learns of the disconnect;
  hundreds of dropped streams wrote thousands of them;
* ``Invalid HTTP request received.`` (the ``uvicorn.error`` logger): once per malformed request.

``RepeatedLineFilter`` drops its line and lets one through per ``interval_s``, rewritten as
``N <what> in the last T s (M in all)``. ``install_quiet_logging()`` puts one on each logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["INVALID_REQUEST_MESSAGE", "SEND_ERROR_MESSAGE", "RepeatedLineFilter",
           "install_quiet_logging"]

SEND_ERROR_MESSAGE = "socket.send() raised exception."
INVALID_REQUEST_MESSAGE = "Invalid HTTP request received."


class RepeatedLineFilter(logging.Filter):
    """Drops every record whose message is ``message``; turns one per interval into a count."""

    def __init__(self, message: str, what: str, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.message = message
        self.what = what
        self.interval_s = interval_s
        self.num_total = 0
        self._clock = clock
        self._num_since_line = 0
        self._last_line_s: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.message:
            return True
        self.num_total += 1
        self._num_since_line += 1
        now_s = self._clock()
        if self._last_line_s is not None and now_s - self._last_line_s < self.interval_s:
            return False
        window_s = self.interval_s if self._last_line_s is None else now_s - self._last_line_s
        record.msg = "%d %s in the last %.0f s (%d in all); counted, not logged one by one"
        record.args = (self._num_since_line, self.what, window_s, self.num_total)
        record.exc_info = record.exc_text = None
        self._num_since_line = 0
        self._last_line_s = now_s
        return True


def install_quiet_logging(interval_s: float = 60.0,
                          clock: Callable[[], float] = time.monotonic
                          ) -> tuple[RepeatedLineFilter, RepeatedLineFilter]:
    """One filter on the ``asyncio`` logger (send errors), one on ``uvicorn.error`` (invalid
    requests); returned for inspection."""
    sends = RepeatedLineFilter(SEND_ERROR_MESSAGE, "write(s) to disconnected clients",
                               interval_s, clock)
    invalid = RepeatedLineFilter(INVALID_REQUEST_MESSAGE, "invalid HTTP request(s)",
                                 interval_s, clock)
    logging.getLogger("asyncio").addFilter(sends)
    logging.getLogger("uvicorn.error").addFilter(invalid)
    return sends, invalid
