"""A scenario's report: the checks against their thresholds, a markdown table, a timeline.

``checks(...)`` turns each policy's verdict into pass/fail lines (thresholds from
``chaos.verdict.THRESHOLDS``; the goodput, recovery, attempts and lost targets are the ``slo``
policy's, hung clients and over-admission hold for every policy) plus the cross-policy check
that ``slo`` served as large a share of good users as ``always_admit`` (within the no-harm
bar; streams a kill cut are left out of both shares).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from chaos.cost_report import block_section, combine_blocks
from chaos.faults import FaultEvent
from chaos.user_record import UserRecord
from chaos.verdict import THRESHOLDS, series, slo_vs_always_admit
from policies.cost import RequestClass

__all__ = ["checks", "render_table", "render_report", "plot_timelines", "policy_costs"]

_SERIES_STYLE = (("offered_users", "offered users/s", "grey", ":"),
                 ("attempts", "upstream attempts/s", "tab:orange", "-"),
                 ("admitted", "admitted/s", "tab:blue", "-"),
                 ("good_users", "goodput (good users/s)", "tab:green", "-"),
                 ("shed", "shed/s (429/503)", "tab:red", "--"))


def _check(value, ok: bool | None, threshold: str) -> dict:
    return {"value": value, "threshold": threshold, "pass": ok}


def _policy_checks(policy: str, v: Mapping, time_scale: float, redis_down: bool) -> dict:
    out = {"valid": _check(v["valid"], v["valid"], "generator kept its schedule")}
    out["num_hung"] = _check(v["num_hung"], v["num_hung"] == 0, "0")
    if v["over_admission_ratio"] is not None:
        limit = THRESHOLDS["over_admission_ratio"]["max_redis_down" if redis_down
                                                   else "max_redis_up"]
        out["over_admission_ratio"] = _check(v["over_admission_ratio"],
                                             v["over_admission_ratio"] <= limit, f"<= {limit}")
    if policy != "slo":
        return out
    g = v["goodput_over_surviving_capacity"]
    out["goodput_over_surviving_capacity"] = _check(g, g is not None and g >= 0.9, ">= 0.9")
    rec, max_rec = v["recovery_s"], THRESHOLDS["recovery_s"]["max_scaled_s"] * time_scale
    out["recovery_s"] = _check(rec, rec is not None and rec <= max_rec, f"<= {max_rec:g} s")
    a = v["attempts_per_sdk_user"]
    if a is not None:
        out["attempts_per_sdk_user"] = _check(a, a <= 1.10, "<= 1.10")
    cut = v.get("num_cut_by_proxy_kill") or 0
    at_gateway = v.get("num_cut_by_replica_kill_at_gateway") or 0
    besides = [f"the {cut} stream(s) cut by the proxy kill"] if cut else []
    if at_gateway:
        besides.append(f"the {at_gateway} stream(s) Envoy cut mid-body when their replica was "
                       "killed (no gateway policy can save them: nothing can write an error "
                       "event first)")
    out["num_lost"] = _check(v["num_lost"], v["num_lost"] - cut - at_gateway == 0,
                             f"0 besides {' and '.join(besides)}" if besides else "0")
    return out


def checks(verdicts: Mapping[str, Mapping], time_scale: float, redis_down: bool) -> dict:
    """Per policy: figure -> {value, threshold, pass}; plus ``slo_vs_always_admit``."""
    out = {p: _policy_checks(p, v, time_scale, redis_down) for p, v in verdicts.items()}
    if "slo" in verdicts and "always_admit" in verdicts:
        slo, base, ok = slo_vs_always_admit(verdicts["slo"], verdicts["always_admit"])
        ratio = THRESHOLDS["slo_vs_always_admit"]["min_ratio"]
        out["slo_vs_always_admit"] = _check(
            {"slo_good_share": _round(slo), "always_admit_good_share": _round(base),
             "slo_good": verdicts["slo"]["judged_good"],
             "always_admit_good": verdicts["always_admit"]["judged_good"]}, ok,
            f"slo's good share >= {ratio:g} x always_admit's (users of tenants without a "
            "budget, less streams cut by a kill)")
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _lost(v: Mapping) -> str:
    cut = v.get("num_cut_by_proxy_kill") or 0
    at_gateway = v.get("num_cut_by_replica_kill_at_gateway") or 0
    parts = ([f"{cut} cut by the proxy kill"] if cut else []) + (
        [f"{at_gateway} cut by Envoy at the replica kill"] if at_gateway else [])
    n = v["outcomes"]["lost"]
    return f"{n} ({', '.join(parts)})" if parts else str(n)


def _error(v: Mapping) -> str:
    cut = v.get("num_cut_by_replica_kill") or 0
    n = v["outcomes"]["error"]
    return f"{n} ({cut} cut by the replica kill)" if cut else str(n)


def render_table(verdicts: Mapping[str, Mapping]) -> str:
    head = ("| policy | valid | goodput ÷ surviving C | recovery (s) | attempts / user | "
            "attempts / SDK user | good | late | error | lost | hung | over-admission |")
    lines = [head, "|" + "---|" * 12]
    for p, v in verdicts.items():
        o = v["outcomes"]
        lines.append(
            f"| {p} | {'yes' if v['valid'] else '**no**'} | "
            f"{_fmt(v['goodput_over_surviving_capacity'])} | "
            f"{'never' if v['recovery_s'] is None else _fmt(v['recovery_s'], 1)} | "
            f"{_fmt(v['attempts_per_user'])} | {_fmt(v['attempts_per_sdk_user'])} | "
            f"{o['good']} | {o['late']} | {_error(v)} | {_lost(v)} | {o['hung']} | "
            f"{_fmt(v['over_admission_ratio'])} |")
    return "\n".join(lines)


def _generator_table(verdicts: Mapping[str, Mapping]) -> str:
    lines = ["| policy | scheduled (users/s) | achieved | send lag p99 (ms) | CPU (% of a core) "
             "| waited for a CPU (s) | longest GC pause (ms) | loop lag max (ms) | warnings |",
             "|" + "---|" * 9]
    for p, v in verdicts.items():
        g = v["generator"]
        lag, gc_s, loop_s = (g["send_lag_s"].get("p99"), g.get("gc_pause_max_s"),
                             g.get("loop_lag_max_s"))
        lines.append(f"| {p} | {_fmt(g['scheduled_rate_per_s'])} | "
                     f"{_fmt(g['achieved_rate_per_s'])} | "
                     f"{'—' if lag is None else f'{1000 * lag:.0f}'} | "
                     f"{g['cpu_percent_of_one_core']:.0f} | {_fmt(g['cpu_wait_s'], 1)} | "
                     f"{'—' if gc_s is None else f'{1000 * gc_s:.0f}'} | "
                     f"{'—' if loop_s is None else f'{1000 * loop_s:.0f}'} | "
                     f"{'; '.join(v['generator_warnings']) or 'none'} |")
    for p, v in verdicts.items():
        e = v["generator"].get("entry_balancer") or {}
        if e.get("connect_failures"):
            lines.append("")
            lines.append(f"{p}: the entry balancer (nginx's defaults: a refused connect goes "
                         f"on to the next entry, which is left out for "
                         f"{e['fail_timeout_s']:g} s) sent {e['failovers']} refused "
                         f"connect(s) on; refused per entry: {e['connect_failures']}.")
    return "\n".join(lines)


def _check_lines(result: Mapping) -> list[str]:
    out = []
    for group, items in result["checks"].items():
        for name, c in ([("", items)] if "pass" in items else items.items()):
            mark = "pass" if c["pass"] else "**FAIL**"
            out.append(f"- {group}{'.' + name if name else ''}: {c['value']} "
                       f"(target {c['threshold']}) {mark}")
    return out


def policy_costs(verdicts: Mapping[str, Mapping]) -> dict:
    """One cost block over the policies (each verdict's ``cost``), labelled with the policy."""
    return combine_blocks([(policy, v.get("cost")) for policy, v in verdicts.items()])


def render_report(result: Mapping) -> str:
    """``report.md``: the table, every check, the cost, and the load generator's own
    account."""
    return "\n".join([
        f"# kvguard chaos {result['scenario']}{' (quick)' if result['quick'] else ''}", "",
        f"{result['summary']}. Capacity per replica {result['capacity_per_replica_rps']:.2f} "
        f"req/s ({result['capacity_source']}), fleet C {result['fleet_capacity_rps']:.2f} req/s, "
        f"time scale {result['time_scale']:g}, seed {result['seed']}.", "",
        f"Command: `{result['command']}`", "", render_table(result["policies"]), "",
        "## Checks", "", *_check_lines(result), "",
        f"All checks passed: **{result['passed']}**", "",
        *block_section(policy_costs(result["policies"])), "## Load generator", "",
        _generator_table(result["policies"]), "", "![timeline](timeline.png)", ""])


def _markers(ax, events: Sequence[FaultEvent], window_s: Sequence[float]) -> None:
    ax.axvspan(window_s[0], window_s[1], color="red", alpha=0.08)
    for e in events:
        if e.action == "healthy":
            continue
        ax.axvline(e.t_s, color="black", linewidth=0.8, linestyle="-.")
        ax.annotate(f"{e.target} {e.action}", (e.t_s, 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7)


def plot_timelines(runs: Mapping[str, tuple[Sequence[UserRecord], Sequence[FaultEvent], Mapping]],
                   cls: RequestClass, end_s: float, bin_s: float, path: Path,
                   title: str) -> Path:
    """One panel per policy: offered users, upstream attempts, admitted, goodput and shed per
    second, the judged fault window shaded and every fault action marked."""
    fig = Figure(figsize=(10, 3.0 * len(runs) + 0.6))
    axes = [fig.add_subplot(len(runs), 1, i + 1) for i in range(len(runs))]
    for ax, (policy, (users, events, verdict)) in zip(axes, runs.items(), strict=True):
        s = series(users, cls, end_s, bin_s)
        for key, label, color, style in _SERIES_STYLE:
            ax.step(s["t_s"], s[key], where="post", label=label, color=color, linestyle=style)
        _markers(ax, events, verdict["fault_window_s"])
        ax.set_title(f"{policy}", fontsize=10, loc="left")
        ax.set_ylabel("per second")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=7, ncol=3)
    axes[-1].set_xlabel("run time (s)")
    fig.suptitle(textwrap.fill(title, 110), fontsize=11)  # a long summary stays on the page
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
