"""PNG plots of a run and of a sweep (matplotlib ``Figure`` objects, Agg canvas, no pyplot state)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from chaos.records import RequestRecord

__all__ = ["per_second", "plot_timeline", "plot_latency_cdfs", "plot_sweep"]


def per_second(times_s: Sequence[float], num_bins: int) -> list[int]:
    """Counts of events in each whole second ``[i, i + 1)`` for ``i < num_bins``."""
    bins = [0] * num_bins
    for t in times_s:
        i = math.floor(t)
        if 0 <= i < num_bins:
            bins[i] += 1
    return bins


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_timeline(records: Sequence[RequestRecord], good: Sequence[bool], path: Path,
                  warmup_s: float = 0.0) -> Path:
    """Offered (by arrival), completed and goodput (by finish time) per second."""
    finish = [(r.sent_s or 0.0) + (r.e2e_s or 0.0) for r in records]
    end_s = max([1.0, *finish, *(r.scheduled_s for r in records)])
    n = math.ceil(end_s) + 1
    xs = list(range(n))
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    ax.step(xs, per_second([r.scheduled_s for r in records], n), where="post", label="offered")
    ax.step(xs, per_second([f for r, f in zip(records, finish, strict=True) if r.successful], n),
            where="post", label="completed")
    ax.step(xs, per_second([f for f, g in zip(finish, good, strict=True) if g], n),
            where="post", linestyle="--", label="goodput (strict SLO)")
    if warmup_s > 0:
        ax.axvspan(0, warmup_s, color="grey", alpha=0.15, label="warm-up (excluded)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests / s")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _cdf(ax, values: Sequence[float], title: str, limit_s: float | None) -> None:
    xs = sorted(values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
    if limit_s is not None:
        ax.axvline(limit_s, color="red", linestyle="--", label=f"SLO {limit_s:g} s")
        ax.legend(loc="lower right")
    ax.set_title(title)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.3)


def plot_latency_cdfs(records: Sequence[RequestRecord], path: Path,
                      ttft_limit_s: float | None = None,
                      itl_limit_s: float | None = None) -> Path:
    """CDFs of TTFT and of every inter-token gap over completed requests."""
    done = [r for r in records if r.successful]
    fig = Figure(figsize=(9, 3.8))
    _cdf(fig.add_subplot(1, 2, 1), [r.ttft_s for r in done if r.ttft_s is not None],
         "TTFT", ttft_limit_s)
    _cdf(fig.add_subplot(1, 2, 2), [g for r in done for g in r.itl_s], "inter-token gap",
         itl_limit_s)
    return _save(fig, path)


def plot_sweep(rates: Sequence[float], offered: Sequence[float], completed: Sequence[float],
               good: Sequence[float], path: Path, capacity_rate: float | None = None) -> Path:
    """Completion rate and goodput against the declared arrival rate, the capacity knee marked.

    ``offered`` is the realized arrival rate of each point (a Poisson schedule is not exact).
    """
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ax.plot(rates, rates, color="grey", linestyle=":", label="declared")
    ax.plot(rates, offered, color="grey", marker="x", linestyle="none", label="offered / s")
    ax.plot(rates, completed, marker="o", label="completed / s")
    ax.plot(rates, good, marker="s", label="goodput / s (strict)")
    if capacity_rate is not None:
        ax.axvline(capacity_rate, color="red", linestyle="--",
                   label=f"capacity {capacity_rate:g} req/s")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("requests / s")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, path)
