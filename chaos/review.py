"""``kvguard review``: does a change improve useful service, all things included?

    kvguard review --baseline A.toml --candidate B.toml [--seeds N] [--quick] [--out DIR]

Each file is a fleet (``chaos.review_fleet``). Every scenario of ``chaos.review_scenarios``
runs on a fresh baseline fleet and a fresh candidate fleet with the same seeded arrivals, once
per seed; ``chaos.review_verdict`` compares the per-seed numbers. ``DIR`` gets ``review.json``,
``review.md`` (a table per scenario, the verdicts) and ``review.png``. The exit code is 1 when
the candidate is worse in any scenario, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from chaos.cost import format_usd
from chaos.review_fleet import FleetSpec, load_fleet
from chaos.review_run import run_cell
from chaos.review_scenarios import capacity_gpu_rps, scenario_matrix
from chaos.review_verdict import ABSOLUTE_METRICS, METRICS, WORSE, combine, compare
from policies.cost import RequestClass

__all__ = ["configure", "run", "review", "judge", "render_markdown", "plot_review"]

TTFT_SLO_S, ITL_SLO_S = 1.0, 0.08  # GPU seconds: the interactive class


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", help="the baseline fleet (TOML)")
    p.add_argument("--candidate", help="the candidate fleet (TOML)")
    p.add_argument("--rejudge", metavar="REVIEW_JSON",
                   help="no runs: judge the cells of an earlier review.json again (e.g. with "
                        "another --min-effect) and rewrite its report into --out")
    p.add_argument("--seeds", type=int, default=3, help="seeded runs per scenario and fleet")
    p.add_argument("--quick", action="store_true",
                   help="half-length scenarios (about 13 min on 2 cores with 3 seeds)")
    p.add_argument("--scenario", action="append", default=[],
                   help="run only these scenarios (repeatable)")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per simulated GPU second")
    p.add_argument("--min-effect", type=float, default=0.05,
                   help="smallest relative change that counts as a change")
    p.add_argument("--out", default="runs/review", help="output directory")


def review(baseline: FleetSpec, candidate: FleetSpec, seeds: int, quick: bool, k: float,
           out: Path, only: list[str] | None = None, min_effect: float = 0.05,
           log=print) -> dict:
    """Run the matrix; the per-cell numbers, per-metric and per-scenario verdicts."""
    if seeds < 1:
        raise ValueError(f"--seeds: must be >= 1, got {seeds}")
    if not k > 0:
        raise ValueError(f"--time-scale: must be > 0, got {k}")
    matrix = scenario_matrix(quick)
    known = {s.name for s in matrix}
    if only and set(only) - known:
        raise ValueError(f"--scenario: unknown {sorted(set(only) - known)}; known: {sorted(known)}")
    matrix = [s for s in matrix if not only or s.name in only]
    cls = RequestClass("interactive", TTFT_SLO_S * k, ITL_SLO_S * k)
    scenarios = {}
    for scenario in matrix:
        capacity_rps = capacity_gpu_rps(scenario, baseline) / k  # C, wall req/s
        cells: dict[str, list[dict]] = {"baseline": [], "candidate": []}
        for seed in range(seeds):
            for side, fleet in (("baseline", baseline), ("candidate", candidate)):
                started = time.monotonic()
                cell = run_cell(fleet, scenario.scaled(k), seed, capacity_rps, k, cls,
                                out / scenario.name / f"{side}-seed{seed}")
                cells[side].append(cell)
                log(f"{scenario.name} seed {seed} {side}: goodput/C {cell['goodput_ratio']:.3f}, "
                    f"$/good {format_usd(cell['cost_per_good_request_usd'])} "
                    f"({time.monotonic() - started:.0f} s)")
        scenarios[scenario.name] = {"description": scenario.description, "cells": cells,
                                    "prompt_tokens": scenario.prompt_tokens,
                                    "capacity_gpu_rps": capacity_rps * k}
    return judge({"baseline": baseline.name, "candidate": candidate.name, "seeds": seeds,
                  "quick": quick, "time_scale": k, "scenarios": scenarios}, min_effect)


def judge(report: dict, min_effect: float = 0.05) -> dict:
    """Add the per-metric, per-scenario and overall verdicts to a report's cells."""
    for s in report["scenarios"].values():
        cells = s["cells"]
        s["metrics"] = {m: compare(m, [c[m] for c in cells["baseline"]],
                                   [c[m] for c in cells["candidate"]], min_effect).to_dict()
                        for m in METRICS}
        s["verdict"] = combine([v["verdict"] for v in s["metrics"].values()])
    report["min_effect"] = min_effect
    report["verdict"] = combine([s["verdict"] for s in report["scenarios"].values()])
    return report


def _cell(metric: str, triple: list[float] | None) -> str:
    if triple is None:
        return "n/a"
    est, lo, hi = triple
    if metric == "cost_per_good_request_usd":
        return f"{format_usd(est)} [{format_usd(lo)}, {format_usd(hi)}]"
    if metric in ("wasted_share", "goodput_ratio"):
        return f"{est:.3f} [{lo:.3f}, {hi:.3f}]"
    return f"{est:.4g} [{lo:.4g}, {hi:.4g}]"


def render_markdown(report: dict) -> str:
    lines = [f"# kvguard review: {report['candidate']} vs {report['baseline']}", "",
             f"{report['seeds']} seed(s) per scenario and fleet, {'quick' if report['quick'] else 'full'} "
             f"scenarios, time scale {report['time_scale']:g}; C per scenario: the baseline's "
             "saturation throughput on that traffic (GPU time; chaos/review_capacity.py): "
             + ", ".join(f"{n} {s['capacity_gpu_rps']:.3g} req/s"
                         for n, s in report["scenarios"].items() if "capacity_gpu_rps" in s)
             + ". Intervals: 95 % bootstrap over seeds. **Overall: " + report["verdict"] + "**",
             "",
             "| scenario | metric | baseline | candidate | change | verdict |",
             "|---|---|---|---|---|---|"]
    for name, s in report["scenarios"].items():
        for metric, v in s["metrics"].items():
            change = v["relative_change"]
            unit = " pt" if metric in ABSOLUTE_METRICS else "%"
            lines.append(f"| {name} | {metric} | {_cell(metric, v['baseline'])} | "
                         f"{_cell(metric, v['candidate'])} | "
                         f"{'n/a' if change is None else f'{100 * change[0]:+.1f}{unit}'} | "
                         f"{v['verdict']} |")
        lines.append(f"| **{name}** | | | | | **{s['verdict']}** |")
    return "\n".join(lines + ["", "![review](review.png)", ""])


def plot_review(report: dict, path: Path) -> Path:
    """Per scenario: goodput ÷ C and cost per good request, baseline vs candidate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(report["scenarios"])
    fig = Figure(figsize=(max(6.0, 1.4 * len(names) + 2), 6))
    for row, metric in enumerate(("goodput_ratio", "cost_per_good_request_usd")):
        ax = fig.add_subplot(2, 1, row + 1)
        for offset, side in ((-0.2, "baseline"), (0.2, "candidate")):
            values = [report["scenarios"][n]["metrics"][metric][side] for n in names]
            ests = [0.0 if v is None else v[0] for v in values]
            errs = [[0.0 if v is None else v[0] - v[1] for v in values],
                    [0.0 if v is None else v[2] - v[0] for v in values]]
            ax.bar([i + offset for i in range(len(names))], ests, 0.4, yerr=errs, label=side)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(metric)
        ax.legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rejudge:
        report = judge(json.loads(Path(args.rejudge).read_text()), args.min_effect)
    else:
        if not args.baseline or not args.candidate:
            raise ValueError("give --baseline and --candidate (or --rejudge)")
        baseline, candidate = load_fleet(args.baseline), load_fleet(args.candidate)
        started = time.monotonic()
        report = review(baseline, candidate, args.seeds, args.quick, args.time_scale, out,
                        args.scenario or None, args.min_effect,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
        report["wall_s"] = time.monotonic() - started
    (out / "review.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "review.md").write_text(render_markdown(report))
    plot_review(report, out / "review.png")
    for name, s in report["scenarios"].items():
        print(f"{name}: {s['verdict']}")
    print(f"overall: {report['verdict']} ({report.get('wall_s', 0):.0f} s); {out / 'review.md'}")
    return 1 if report["verdict"] == WORSE else 0
