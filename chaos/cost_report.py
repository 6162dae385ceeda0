"""The cost section of a report: a markdown table per window and a stacked-bar plot.

Input is ``WindowCost.to_dict()`` (what ``summary.json`` / ``cost.json`` hold), so a report can
be re-rendered from the JSON alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from chaos.cost import format_usd
from guard.observe.cost_config import COMPONENTS

__all__ = ["cost_rows", "cost_section", "block_section", "plot_cost", "has_cost",
           "combine_blocks"]


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _where(w: Mapping) -> str:
    span = f"[{w['window_s'][0]:g}, {w['window_s'][1]:g})"
    return f"{w['label']} {span}" if w.get("label") else span


def cost_rows(windows: Sequence[Mapping]) -> list[str]:
    """One row per window: total, components, good, cost per good request, wasted share."""
    rows = ["| window (s) | total | accelerator (idle) | host | network | idle reserve | energy "
            "| good | $/good request | $/M good output tokens | wasted | wasted share |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in windows:
        c = w["components_usd"]
        rows.append(
            f"| {_where(w)} | {format_usd(w['total_usd'])} | "
            f"{format_usd(c['accelerator'])} ({format_usd(w['accelerator_idle_usd'])}) | "
            f"{format_usd(c['host'])} | {format_usd(c['network'])} | "
            f"{format_usd(c['idle_reserve'])} | {format_usd(c['energy'])} | {w['num_good']} | "
            f"{format_usd(w['cost_per_good_request_usd'])} | "
            f"{format_usd(w['cost_per_million_good_output_tokens_usd'])} | "
            f"{format_usd(w['wasted_usd'])} | {_share(w['wasted_share'])} |")
    return rows


def _wasted_lines(windows: Sequence[Mapping]) -> list[str]:
    lines = []
    for w in windows:
        parts = [f"{axis} " + ", ".join(f"{k} {format_usd(v)}" for k, v in sorted(w[key].items()))
                 for axis, key in (("by class:", "wasted_by_class_usd"),
                                   ("by tenant:", "wasted_by_tenant_usd")) if w[key]]
        if parts:
            lines.append(f"- wasted in {_where(w)}: "
                         + "; ".join(parts))
    return lines


def cost_section(windows: Sequence[Mapping], plot_name: str | None = "cost.png") -> list[str]:
    """Markdown lines: the table, the wasted split, the plot link."""
    lines = ["## Cost", "",
             "Accelerator busy time is shared by each engine step's work; idle is what no "
             "step used. $/good request is n/a in a window with no good request.", "",
             *cost_rows(windows), "", *_wasted_lines(windows)]
    if plot_name:
        lines += ["", f"![cost per window]({plot_name})"]
    return lines + [""]


def has_cost(block: Mapping | None) -> bool:
    """A cost block (``chaos.run_cost``) with priced windows."""
    return bool(block and block.get("windows"))


def combine_blocks(runs: Sequence[tuple[str, Mapping | None]]) -> dict:
    """One cost block over several runs' blocks (``(name, block)``; one row per run, say),
    each window labelled ``name`` (``name: label`` where it had one). With no numbers at all,
    the block says why, run by run."""
    windows, why = [], []
    for name, block in runs:
        if has_cost(block):
            windows += [{**w, "label": f"{name}: {w['label']}" if w.get("label") else name}
                        for w in block["windows"]]
        else:
            why.append(f"{name}: {(block or {}).get('unavailable', 'no engine step trace')}")
    if not windows:
        return {"windows": [], "unavailable": "; ".join(why) or "no runs"}
    first = next(b for _, b in runs if has_cost(b))
    return {**{k: v for k, v in first.items() if k != "windows"}, "windows": windows}


def block_section(block: Mapping, plot_name: str | None = "cost.png") -> list[str]:
    """The cost section of a cost block: the table, or why there are no numbers."""
    if not has_cost(block):
        return ["## Cost", "", f"No cost for this run: {block.get('unavailable', 'no windows')}.",
                ""]
    lines = cost_section(block["windows"], plot_name)
    if block.get("gpu"):
        lines[2:2] = [f"Prices: {block['gpu']} at ${block['accelerator_usd_per_gpu_hour']:g} per "
                      f"GPU-hour (nothing else priced unless a [cost] table says so); sim time "
                      f"scale {block['time_scale']:g}: windows are wall seconds, priced as "
                      "GPU time.", ""]
    return lines


def plot_cost(windows: Sequence[Mapping], path: Path) -> Path:
    """Stacked bars per window: accelerator busy (useful and wasted), idle, and the rest."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [w.get("label") or f"{w['window_s'][0]:g}-{w['window_s'][1]:g}" for w in windows]
    wasted = [w["wasted_usd"] for w in windows]
    useful = [w["accelerator_busy_usd"] - w["wasted_usd"] for w in windows]
    idle = [w["accelerator_idle_usd"] for w in windows]
    others = {k: [w["components_usd"][k] for w in windows] for k in COMPONENTS
              if k != "accelerator"}
    fig = Figure(figsize=(max(5.0, 1.2 * len(windows) + 3), 4))
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(windows)
    for name, values in [("busy, useful", useful), ("busy, wasted", wasted),
                         ("accelerator idle", idle), *others.items()]:
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("US dollars")
    ax.set_xlabel("run" if any(w.get("label") for w in windows) else "window (s)")
    if len(windows) > 4:
        ax.tick_params(axis="x", labelrotation=30)
    ax.set_title("cost per window")
    ax.legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
