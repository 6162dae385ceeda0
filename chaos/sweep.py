"""The open-loop capacity curve: the same load at increasing arrival rates.

Pure parts only (parsing the sweep, finding the knee); ``chaos.load_cli`` runs the points.
Capacity is the highest swept rate up to which goodput stays at or above ``min_ratio`` of the
offered load at every swept rate — the knee of the curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SweepPoint", "sweep_rates", "capacity", "capacity_label"]

MIN_GOODPUT_RATIO = 0.9


@dataclass(frozen=True)
class SweepPoint:
    rate_per_s: float
    num_offered: int
    offered_per_s: float       # arrivals in the window / window length (the realized rate)
    completed_per_s: float
    goodput_per_s: float
    goodput_ratio: float | None  # strict good / offered, over the window
    out_dir: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sweep_rates(spec: str, base_rate_per_s: float) -> list[float]:
    """``"a:b:step"`` multiples of ``base_rate_per_s``, from a to b inclusive."""
    try:
        lo, hi, step = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"bad --sweep {spec!r}: use START:STOP:STEP (multiples of the base "
                         "rate), e.g. 0.5:2:0.25") from None
    if base_rate_per_s <= 0 or lo <= 0 or hi < lo or step <= 0:
        raise ValueError(f"bad --sweep {spec!r} with base rate {base_rate_per_s}: need "
                         "0 < START <= STOP, STEP > 0, base rate > 0")
    n = int(round((hi - lo) / step + 1e-9)) + 1
    if n > 100:
        raise ValueError(f"--sweep {spec!r} has {n} points; at most 100")
    return [round(base_rate_per_s * (lo + i * step), 6) for i in range(n)]


def capacity(points: Sequence[SweepPoint], min_ratio: float = MIN_GOODPUT_RATIO) -> float | None:
    """The highest rate such that every point up to it kept goodput >= min_ratio of offered."""
    best = None
    for p in sorted(points, key=lambda p: p.rate_per_s):
        if p.goodput_ratio is None or p.goodput_ratio < min_ratio:
            break
        best = p.rate_per_s
    return best


def capacity_label(points: Sequence[SweepPoint], cap: float | None) -> str:
    """``cap`` for people: ``none``, ``12 req/s``, or ``≥ 16 req/s`` when every swept rate kept
    its goodput (the knee lies beyond the sweep, so the capacity is only a lower bound)."""
    if cap is None:
        return "none"
    top = max(p.rate_per_s for p in points)
    return f"{'≥ ' if cap >= top else ''}{cap:g} req/s"
