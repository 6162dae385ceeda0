"""The overload bench's table and plot: one row per (load, policy), same arrivals per load.

Columns: goodput and goodput ÷ C; goodput ÷ the reference row's at the same load — the bare
replica's (the "no harm below capacity" check, where a ``bare`` row ran), or for a fleet the
``always_admit`` proxy's (routing with no admission); TTFT p50/p99; rejected and timed-out shares;
among admitted requests, the share that missed the SLO and the share that missed only on an
inter-token gap; the gaps over the limit and how many of them the engine step dominated (the
rest: delivery — event loop, write, relay, client); the TTFT forecast's predicted ÷ actual
(median and p90); wasted tokens; and,
where users on the OpenAI SDK ran, their upstream attempts per user and user goodput ÷ C.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from chaos.admission_quality import admitted_misses
from chaos.goodput import meets_slo
from chaos.stats import percentile

__all__ = ["BARE", "fmt_num", "render_table", "render_cache_table", "plot_goodput",
           "add_bare_ratios", "row_from_run"]

BARE = "bare"  # the replica with no guard at all: the reference below capacity


def row_from_run(summary: dict, records: Sequence, scenario, cap_rps: float) -> dict:
    """The table row: goodput, goodput / C, TTFT percentiles, rejections, wasted work."""
    t = summary["goodput"]["total"]
    window = summary["goodput"]["window_s"]
    inside = [r for r in records if window[0] <= r.scheduled_s < window[1]]
    ttfts = [r.ttft_s for r in inside if r.successful and r.ttft_s is not None]
    wasted = sum(r.num_tokens_received for r in inside
                 if not meets_slo(r, scenario.request_class))
    produced = sum(r.num_tokens_received for r in inside)
    counts = summary["counts"]
    return {
        "goodput_rps": t["goodput_per_s"]["strict"],
        "goodput_over_c": t["goodput_per_s"]["strict"] / cap_rps,
        "goodput_p99_gap_rps": t["goodput_per_s"]["p99_gap"],
        "offered_rps": t["offered_per_s"],
        "completed_rps": t["completed_per_s"],
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "rejected_ratio": counts["rejected"] / counts["offered"] if counts["offered"] else 0.0,
        "canceled_ratio": counts["canceled"] / counts["offered"] if counts["offered"] else 0.0,
        "wasted_tokens": wasted,
        "wasted_ratio": wasted / produced if produced else 0.0,
        **admitted_misses(inside, scenario.request_class),
        "warnings": summary["warnings"],
    }


def fmt_num(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def add_bare_ratios(rows: list[dict], reference: str = BARE) -> list[dict]:
    """Each row's goodput ÷ the ``reference`` row's at the same load (None without one), as
    ``goodput_over_<reference>``: ``bare`` for one replica, ``always_admit`` for a fleet."""
    ref_rps = {r["load"]: r["goodput_rps"] for r in rows if r["policy"] == reference}
    for r in rows:
        ref = ref_rps.get(r["load"])
        r[f"goodput_over_{reference}"] = r["goodput_rps"] / ref if ref else None
    return rows


def render_table(rows: list[dict], reference: str = BARE) -> str:
    head = (f"| load (× C) | policy | goodput (req/s) | goodput ÷ C | ÷ {reference} | "
            "TTFT p50 (s) | "
            "TTFT p99 (s) | rejected | timed out | admitted missed (gap) | "
            "gaps over limit (engine step) | TTFT forecast ÷ actual p50 / p90 | wasted tokens | "
            "SDK attempts/user | SDK user goodput ÷ C |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        forecast = r.get("forecast") or {}
        sdk = r.get("sdk") or {}
        gaps = r.get("gaps") or {}
        lines.append(
            f"| {r['load']:.2f} | {r['policy']} | {fmt_num(r['goodput_rps'])} | "
            f"{fmt_num(r['goodput_over_c'])} | {fmt_num(r.get(f'goodput_over_{reference}'))} | "
            f"{fmt_num(r['ttft_p50_s'])} | {fmt_num(r['ttft_p99_s'])} | "
            f"{_pct(r['rejected_ratio'])} | {_pct(r['canceled_ratio'])} | "
            f"{_pct(r.get('missed_share'))} ({_pct(r.get('gap_miss_share'))}) | "
            f"{gaps.get('num_over_limit', '—')} ({gaps.get('num_step', '—')}) | "
            f"{fmt_num(forecast.get('ratio_p50'))} / {fmt_num(forecast.get('ratio_p90'))} | "
            f"{r['wasted_tokens']} ({100 * r['wasted_ratio']:.0f}%) | "
            f"{fmt_num(sdk.get('attempts_per_user'))} | {fmt_num(sdk.get('goodput_over_c'))} |")
    return "\n".join(lines)


def render_cache_table(rows: list[dict]) -> str | None:
    """The prefix-cache view of a fleet run (None when no row measured a hit ratio): goodput
    ÷ C, TTFT p50 / p90, the engines' measured hit ratio and the guard's predicted one."""
    if not any(r.get("engine_hit_ratio") is not None for r in rows):
        return None
    lines = ["| load (× C) | policy | goodput ÷ C | TTFT p50 (s) | TTFT p90 (s) | "
             "engine hit ratio | guard-predicted hit ratio |", "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r['load']:.2f} | {r['policy']} | {fmt_num(r['goodput_over_c'])} | "
            f"{fmt_num(r['ttft_p50_s'])} | {fmt_num(r.get('ttft_p90_s'))} | "
            f"{_pct(r.get('engine_hit_ratio'))} | {_pct(r.get('guard_hit_ratio'))} |")
    return "\n".join(lines)


def plot_goodput(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, pol in enumerate(policies):
        ys = [next((r["goodput_over_c"] for r in rows
                    if r["policy"] == pol and r["load"] == load), 0.0) for load in loads]
        ax.bar([j + i * width for j in range(len(loads))], ys, width, label=pol)
    ax.axhline(0.9, color="k", linestyle="--", linewidth=1, label="0.9 C")
    ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(loads))])
    ax.set_xticklabels([f"{load:.2f} × C" for load in loads])
    ax.set_ylabel("goodput ÷ capacity C")
    ax.set_title("Goodput under overload, per admission policy (same arrivals)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
