"""The output folder of one run: raw records, summary, a markdown report and plots.

Files written by ``write_run``::

    requests.jsonl      one RequestRecord per line, in schedule order
    summary.json        chaos.summary.build_summary
    report.md           the summary as a human report
    timeline.png        offered / completed / goodput per second
    latency_cdf.png     TTFT and inter-token gap CDFs
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from chaos.cost_report import block_section, has_cost, plot_cost
from chaos.goodput import VARIANTS, Window, meets_slo
from chaos.plots import plot_latency_cdfs, plot_timeline
from chaos.records import RequestRecord
from policies.cost import RequestClass

__all__ = ["RUN_FILES", "write_run", "read_records", "render_markdown"]

RUN_FILES: tuple[str, ...] = ("requests.jsonl", "summary.json", "report.md", "timeline.png",
                              "latency_cdf.png")


def read_records(path: Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def _fmt(x, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{digits}g}"


def _latency_rows(latency: Mapping) -> list[str]:
    rows = ["| metric | count | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for name, d in latency.items():
        if name == "queue_ms":
            continue
        rows.append(f"| {name} | {d['count']} | {_fmt(d['p50'])} | {_fmt(d['p90'])} | "
                    f"{_fmt(d['p99'])} | {_fmt(d['max'])} |")
    return rows


def _goodput_rows(gp: Mapping) -> list[str]:
    rows = ["| class | offered | completed | good strict | good p99-gap | good mean-TPOT | "
            "goodput/s strict | ratio strict |", "|---|---|---|---|---|---|---|---|"]
    for name, c in [("**total**", gp["total"]), *gp["per_class"].items()]:
        good = c["num_good"]
        rows.append(f"| {name} | {c['num_offered']} | {c['num_successful']} | "
                    + " | ".join(str(good[v]) for v in VARIANTS)
                    + f" | {c['goodput_per_s']['strict']:.2f} | "
                    f"{_fmt(c['goodput_ratio']['strict'])} |")
    return rows


def _server_lines(server: Mapping | None) -> list[str]:
    if not server:
        return ["", "Server metrics: not scraped."]
    rec = server.get("reconcile")
    if rec is None:
        return ["", f"Server metrics ({', '.join(server.get('urls') or [])}): no known "
                "outcome counters."]
    lines = ["", f"## Server reconciliation ({rec['kind']} counters)", "",
             "| outcome | client | server |", "|---|---|---|"]
    for o, row in rec["by_outcome"].items():
        lines.append(f"| {o} | {row['client']} | {row['server']} |")
    lines.append(f"\nAll match: **{rec['matches']}**")
    if not rec["matches"]:
        settled = ", ".join(f"{k} {v}" for k, v in rec["num_canceled_but_settled"].items() if v)
        lines.append(f"Explained by client cancels: **{rec['explained']}** "
                     f"({rec['num_canceled_unseen']} canceled before the server counted them; "
                     f"canceled here but settled there: {settled or 'none'})")
    return lines


def render_markdown(summary: Mapping) -> str:
    """The summary as a markdown report."""
    c, lg = summary["counts"], summary["load_generator"]
    w0, w1 = summary["goodput"]["window_s"]
    lines = [
        "# kvguard load report", "",
        f"- shape **{summary['shape']}**, declared **{summary['declared_rate_per_s']:g} req/s** "
        f"(mean {summary['declared_mean_rate_per_s']:.3g}) for {summary['duration_s']:g} s; "
        f"goodput window [{w0:g}, {w1:g}) s by arrival",
        f"- scheduled {_fmt(summary['scheduled_rate_per_s'])} req/s, achieved "
        f"{_fmt(summary['achieved_rate_per_s'])} req/s; send lag p99 "
        f"{_fmt(summary['send_lag_s']['p99'], 1000)} ms; load generator CPU "
        f"{lg['cpu_percent_of_one_core']:.0f}% of one core, waited for a CPU "
        f"{_fmt(lg['cpu_wait_s'])} s of {lg['wall_s']:.3g} s",
        f"- offered {c['offered']} = completed {c['completed']} + rejected {c['rejected']} + "
        f"failed {c['failed']} + canceled {c['canceled']} (reconciles: {summary['reconciles']})",
    ]
    for key in ("rejected_by", "failed_by", "canceled_by"):
        if c[key]:
            lines.append(f"- {key.replace('_', ' ')}: "
                         + ", ".join(f"{k}: {v}" for k, v in c[key].items()))
    lines += [f"- **WARNING**: {w}" for w in summary["warnings"]]
    lines += ["", "## Goodput", "", *_goodput_rows(summary["goodput"]),
              "", "## Latency (completed requests, seconds)", "",
              *_latency_rows(summary["latency"]), *_server_lines(summary.get("server")),
              "", "![timeline](timeline.png)", "", "![latency CDFs](latency_cdf.png)", ""]
    if summary.get("cost"):
        lines += block_section(summary["cost"])
    return "\n".join(lines)


def write_run(out_dir: Path, records: Sequence[RequestRecord], summary: Mapping,
              classes: Mapping[str, RequestClass], window: Window) -> dict[str, Path]:
    """Write every run file into ``out_dir`` (created) and return their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in RUN_FILES}
    with open(paths["requests.jsonl"], "w") as f:
        f.writelines(r.to_json() + "\n" for r in records)
    paths["summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["report.md"].write_text(render_markdown(summary))
    good = [meets_slo(r, classes[r.request_class]) for r in records]
    plot_timeline(records, good, paths["timeline.png"], warmup_s=window.start_s)
    first = next(iter(classes.values()))
    plot_latency_cdfs(records, paths["latency_cdf.png"], first.ttft_s if len(classes) == 1
                      else None, first.itl_s if len(classes) == 1 else None)
    if has_cost(summary.get("cost")):
        paths["cost.png"] = plot_cost(summary["cost"]["windows"], out_dir / "cost.png")
    return paths
