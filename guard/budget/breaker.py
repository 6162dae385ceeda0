"""The Redis circuit breaker: closed (use Redis) → open after N consecutive failures (local).

Pure state, no I/O: the fallback store records each Redis call's outcome; a successful
reconnect probe closes it again. ``on_change(is_open)`` is called once per transition.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Breaker"]


class Breaker:
    def __init__(self, failures_to_open: int,
                 on_change: Callable[[bool], None] | None = None) -> None:
        if failures_to_open < 1:
            raise ValueError(f"failures_to_open: must be >= 1, got {failures_to_open!r}")
        self.failures_to_open = failures_to_open
        self.is_open = False
        self.num_failures = 0  # consecutive, while closed
        self.num_opens = 0  # transitions to open so far
        self._on_change = on_change

    def record_success(self) -> None:
        self.num_failures = 0

    def record_failure(self) -> None:
        if self.is_open:
            return
        self.num_failures += 1
        if self.num_failures >= self.failures_to_open:
            self.open()

    def open(self) -> None:
        if not self.is_open:
            self.is_open = True
            self.num_opens += 1
            if self._on_change is not None:
                self._on_change(True)

    def close(self) -> None:
        self.num_failures = 0
        if self.is_open:
            self.is_open = False
            if self._on_change is not None:
                self._on_change(False)
