"""Goodput over request records, as pure functions.

A request counts toward goodput when it was **successful** (outcome ``completed``: 2xx, saw
``[DONE]``, no error, not truncated) **and** met its class SLO. Three readings of "met":

- ``strict``    — TTFT ≤ limit and *every* inter-token gap ≤ the ITL limit (the definition);
- ``p99_gap``   — TTFT ≤ limit and the request's p99 gap ≤ the ITL limit;
- ``mean_tpot`` — TTFT ≤ limit and the mean gap (TPOT) ≤ the ITL limit.

Only requests whose **arrival** (``scheduled_s``) falls in the window ``[start_s, end_s)``
are counted, so warm-up and drain are left out. Rates are per second of window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from chaos.records import RequestRecord
from chaos.stats import percentile
from policies.cost import RequestClass

__all__ = ["VARIANTS", "Window", "GoodputCounts", "GoodputReport", "meets_slo", "goodput"]

VARIANTS: tuple[str, ...] = ("strict", "p99_gap", "mean_tpot")


@dataclass(frozen=True)
class Window:
    """Arrival-time window ``[start_s, end_s)`` in run seconds."""

    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_s < self.end_s:
            raise ValueError(f"window needs 0 <= start_s < end_s, got {self}")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def contains(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s


def _gap_stat(itl_s: tuple[float, ...], variant: str) -> float:
    if not itl_s:
        return 0.0  # zero or one token: no gap can be late
    if variant == "strict":
        return max(itl_s)
    if variant == "p99_gap":
        return percentile(itl_s, 99.0) or 0.0
    if variant == "mean_tpot":
        return sum(itl_s) / len(itl_s)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def meets_slo(record: RequestRecord, cls: RequestClass, variant: str = "strict") -> bool:
    """Successful and within ``cls``'s TTFT and ITL limits under ``variant``."""
    if not record.successful or record.ttft_s is None:
        return False
    return record.ttft_s <= cls.ttft_s and _gap_stat(record.itl_s, variant) <= cls.itl_s


@dataclass(frozen=True)
class GoodputCounts:
    """Counts for one class (or the total) over one window."""

    num_offered: int
    num_successful: int
    num_good: Mapping[str, int]  # variant -> requests that met the SLO
    window_s: float

    def rate_per_s(self, variant: str = "strict") -> float:
        return self.num_good[variant] / self.window_s

    def ratio(self, variant: str = "strict") -> float | None:
        """Good / offered, None when nothing was offered."""
        return self.num_good[variant] / self.num_offered if self.num_offered else None

    def to_dict(self) -> dict:
        return {
            "num_offered": self.num_offered,
            "num_successful": self.num_successful,
            "offered_per_s": self.num_offered / self.window_s,
            "completed_per_s": self.num_successful / self.window_s,
            "num_good": dict(self.num_good),
            "goodput_per_s": {v: self.rate_per_s(v) for v in VARIANTS},
            "goodput_ratio": {v: self.ratio(v) for v in VARIANTS},
        }


@dataclass(frozen=True)
class GoodputReport:
    window: Window
    total: GoodputCounts
    per_class: Mapping[str, GoodputCounts]

    def to_dict(self) -> dict:
        return {
            "window_s": [self.window.start_s, self.window.end_s],
            "total": self.total.to_dict(),
            "per_class": {k: v.to_dict() for k, v in self.per_class.items()},
        }


def _count(records: list[RequestRecord], classes: Mapping[str, RequestClass],
           window_s: float) -> GoodputCounts:
    good = {v: sum(meets_slo(r, classes[r.request_class], v) for r in records) for v in VARIANTS}
    return GoodputCounts(len(records), sum(r.successful for r in records), good, window_s)


def goodput(records: Iterable[RequestRecord], classes: Mapping[str, RequestClass],
            window: Window) -> GoodputReport:
    """Goodput per class and in total for the requests that arrived inside ``window``."""
    chosen = [r for r in records if window.contains(r.scheduled_s)]
    unknown = {r.request_class for r in chosen} - set(classes)
    if unknown:
        raise ValueError(f"records name classes with no SLO: {sorted(unknown)}")
    per_class = {
        name: _count([r for r in chosen if r.request_class == name], classes, window.duration_s)
        for name in sorted({r.request_class for r in chosen} | set(classes))
    }
    return GoodputReport(window, _count(chosen, classes, window.duration_s), per_class)
