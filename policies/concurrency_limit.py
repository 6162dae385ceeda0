"""A replica's concurrency limit learned from what it does: AIMD on first tokens, gaps, failures.

For a replica that publishes no load state (or as a check on one that does) the guard learns
how many requests the replica serves at once within their objectives, in the spirit of Netflix
concurrency-limits' AIMD limit and Envoy's adaptive concurrency, but judged on what an LLM
client feels rather than on round-trip time. Each ended request is one :class:`LimitSample`:

* ``GOOD``: it met its class objectives at the replica — first token within the class TTFT
  counted from dispatch (time spent in the guard's own queue is not the replica's doing), every
  content gap within the class ITL;
* ``OVERLOADED``: it missed one of them, or failed in a way overload causes: a 5xx, a 429, a
  reset, a stream that ended without a ``finish_reason`` (an engine that interrupts a running
  stream for a new request, as llama-cpp-python's single-slot server does);
* ``IGNORED``: nothing to learn (the client left, a 4xx for its own request).

The limit grows by ``1 / limit`` per good sample taken while the replica was at its limit (a
sample from an idle replica says nothing about more load), about one per limit's worth of good
requests, and is multiplied by ``backoff_ratio`` on an overload signal — once per congestion
episode: a request dispatched before the last cut ran under the old limit, so its failure does
not cut again. Growth back into the level that last failed is slowed by ``probe_scale``, which
halves each time a probe of that level fails again (down to ``min_probe_scale``) and resets
once a request meets its objectives there: a one-slot engine settles at 1 with ever rarer
probes of 2, instead of failing one request in every few. The limit never falls below
``min_limit`` (1 by default), so the replica is always tried again.

Pure: no clock reads (times come in the samples), no I/O; table-testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.param_check import check

__all__ = ["ConcurrencyLimit", "LimitSample", "GOOD", "OVERLOADED", "IGNORED", "SIGNALS"]

GOOD = "good"
OVERLOADED = "overloaded"
IGNORED = "ignored"
SIGNALS = (GOOD, OVERLOADED, IGNORED)


@dataclass(frozen=True)
class LimitSample:
    """One request that ended on the replica: what it showed and the replica's load then."""

    signal: str  # GOOD, OVERLOADED or IGNORED
    dispatch_s: float  # when the guard sent it to the replica
    now_s: float  # when it ended
    num_inflight: int  # requests in flight on the replica when it ended, itself included


class ConcurrencyLimit:
    """One replica's learned limit; :attr:`value` is the whole number of requests it allows."""

    def __init__(self, initial_limit: float = 4.0, min_limit: float = 1.0,
                 max_limit: float = 256.0, backoff_ratio: float = 0.7,
                 first_probe_scale: float = 0.5, min_probe_scale: float = 1 / 64) -> None:
        check(1 <= min_limit <= max_limit,
              f"need 1 <= min_limit <= max_limit, got {min_limit}, {max_limit}")
        check(min_limit <= initial_limit <= max_limit,
              f"initial_limit {initial_limit} outside [min_limit, max_limit]")
        check(0.0 < backoff_ratio < 1.0, f"backoff_ratio must be in (0, 1), got {backoff_ratio}")
        check(0.0 < min_probe_scale <= first_probe_scale <= 1.0,
              f"need 0 < min_probe_scale <= first_probe_scale <= 1, got {min_probe_scale}, "
              f"{first_probe_scale}")
        self.limit = float(initial_limit)
        self.min_limit, self.max_limit = float(min_limit), float(max_limit)
        self.backoff_ratio = backoff_ratio
        self.first_probe_scale, self.min_probe_scale = first_probe_scale, min_probe_scale
        self.failed_level: int | None = None  # the whole limit at the last cut
        self.probe_scale = 1.0
        self.last_cut_s: float | None = None
        self.num_cuts = 0

    @property
    def value(self) -> int:
        return int(self.limit)

    def update(self, sample: LimitSample) -> int:
        """Learn from one ended request; returns the new :attr:`value`."""
        check(sample.signal in SIGNALS, f"signal must be one of {SIGNALS}, got {sample.signal!r}")
        if sample.signal == GOOD:
            self._grow(sample.num_inflight)
        elif sample.signal == OVERLOADED:
            self._cut(sample.dispatch_s, sample.now_s)
        return self.value

    def _grow(self, num_inflight: int) -> None:
        level = self.value
        if num_inflight < level:
            return  # the replica was not at its limit: no news about more
        if self.failed_level is not None and level >= self.failed_level:
            self.failed_level, self.probe_scale = None, 1.0  # the probe held: level is fine
        step = 1.0 / self.limit
        if self.failed_level is not None and int(self.limit + step) >= self.failed_level:
            step *= self.probe_scale
        self.limit = min(self.max_limit, self.limit + step)

    def _cut(self, dispatch_s: float, now_s: float) -> None:
        if self.last_cut_s is not None and dispatch_s < self.last_cut_s:
            return  # sent under the old limit: this episode was already answered
        level = self.value
        if self.failed_level is not None and level >= self.failed_level:
            self.probe_scale = max(self.min_probe_scale, self.probe_scale / 2)
        else:
            self.probe_scale = self.first_probe_scale
        self.failed_level = max(level, int(self.min_limit) + 1)
        self.limit = max(self.min_limit, self.limit * self.backoff_ratio)
        self.last_cut_s = now_s
        self.num_cuts += 1
