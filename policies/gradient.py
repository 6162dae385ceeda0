"""Latency-gradient adaptive concurrency: Netflix concurrency-limits' Gradient2 (the algorithm
Envoy's adaptive-concurrency filter also follows).

Each latency sample (TTFT by default, or the request's worst inter-token gap) updates

    short_s = the sample
    long_s  = exponential average of samples (plain mean over the first ``warmup_samples``)
    if long_s / short_s > 2:  long_s *= 0.9        # recover fast after a long overload
    unless app-limited (in flight at admission < limit / 2):
        gradient = clamp(rtt_tolerance * long_s / short_s, 0.5, 1.0)
        new      = limit * gradient + queue_size
        limit    = clamp(limit * (1 - smoothing) + new * smoothing, min_limit, max_limit)

so the limit shrinks while latency rises above its long-term baseline and creeps back up by
``queue_size * smoothing`` per sample while it does not. ``decide`` admits while the guard's
in-flight count is below ``int(limit)``, else 503 ``concurrency_limit``. Defaults are Gradient2's
(initial 20, min 20, max 200, smoothing 0.2, queue size 4, long window 600 samples, warmup 10).
``rtt_tolerance`` 1.0 is Gradient2; above 1 it tolerates that much latency rise before shrinking,
like the older Gradient limit and Envoy's gradient controller. Failed requests and samples
without the measure are ignored, as Netflix's limiter ignores dropped calls.
"""

from __future__ import annotations

from policies.concurrency_cap import CONCURRENCY_LIMIT, num_inflight
from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision, Shed
from policies.least_loaded import route_least_loaded
from policies.param_check import check
from policies.snapshot import LoadSnapshot

__all__ = ["Gradient", "LATENCY_MEASURES"]

LATENCY_MEASURES = ("ttft", "max_itl")


class Gradient:
    name = "gradient"

    def __init__(
        self,
        initial_limit: float = 20,
        min_limit: float = 20,
        max_limit: float = 200,
        smoothing: float = 0.2,
        queue_size: float = 4,
        long_window: int = 600,
        warmup_samples: int = 10,
        rtt_tolerance: float = 1.0,
        latency: str = "ttft",
    ) -> None:
        check(
            1 <= min_limit <= max_limit,
            f"need 1 <= min_limit <= max_limit, got {min_limit}, {max_limit}",
        )
        check(
            min_limit <= initial_limit <= max_limit,
            f"initial_limit {initial_limit} outside [min_limit, max_limit]",
        )
        check(0.0 < smoothing <= 1.0, f"smoothing must be in (0, 1], got {smoothing}")
        check(queue_size >= 0, f"queue_size must be >= 0, got {queue_size}")
        check(
            long_window >= 1 and warmup_samples >= 0,
            "long_window must be >= 1, warmup_samples >= 0",
        )
        check(rtt_tolerance >= 1.0, f"rtt_tolerance must be >= 1, got {rtt_tolerance}")
        check(
            latency in LATENCY_MEASURES,
            f"latency must be one of {LATENCY_MEASURES}, got {latency!r}",
        )
        self.limit = float(initial_limit)
        self.min_limit, self.max_limit = float(min_limit), float(max_limit)
        self.smoothing, self.queue_size = smoothing, queue_size
        self.long_window, self.warmup_samples = long_window, warmup_samples
        self.rtt_tolerance, self.latency = rtt_tolerance, latency
        self.long_s: float | None = None
        self.num_samples = 0
        self._inflight_at_admit: dict[str, int] = {}
        self._inflight = 0

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        if num_inflight(snapshot) >= int(self.limit):
            return Shed(503, CONCURRENCY_LIMIT)
        return route_least_loaded(snapshot)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        self._inflight += 1
        self._inflight_at_admit[cost.request_id] = self._inflight

    def observe(self, sample: CompletionSample) -> None:
        inflight = self._inflight_at_admit.pop(sample.request_id, None)
        if inflight is None:
            return  # never admitted through this policy: nothing to release or learn
        self._inflight -= 1
        latency_s = sample.ttft_s if self.latency == "ttft" else sample.max_itl_s
        if sample.ok and latency_s is not None and latency_s > 0:
            self.update(latency_s, inflight)

    def update(self, short_s: float, inflight: int) -> float:
        """Feed one latency sample taken with ``inflight`` requests in flight; returns the limit."""
        long_s = self._add_long(short_s)
        if long_s / short_s > 2.0:
            self.long_s = long_s * 0.9
        if inflight < self.limit / 2:
            return self.limit
        gradient = max(0.5, min(1.0, self.rtt_tolerance * long_s / short_s))
        new_limit = self.limit * gradient + self.queue_size
        new_limit = self.limit * (1.0 - self.smoothing) + new_limit * self.smoothing
        self.limit = max(self.min_limit, min(self.max_limit, new_limit))
        return self.limit

    def _add_long(self, sample_s: float) -> float:
        if self.long_s is None or self.num_samples < self.warmup_samples:
            total_s = (self.long_s or 0.0) * self.num_samples + sample_s
            self.num_samples += 1
            self.long_s = total_s / self.num_samples
        else:
            factor = 2.0 / (self.long_window + 1)
            self.long_s = self.long_s * (1.0 - factor) + sample_s * factor
        return self.long_s
