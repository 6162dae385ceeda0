"""``kvguard bench overload``: the headline comparison, all in one run and one report.

1. Start a sim replica of the reference model (``llama-7b`` on an H100 timing model), probe its
   saturation throughput S with a closed burst, then sweep open-loop rates (multiples of S) to
   measure capacity C: the highest rate whose goodput stays >= 90 % of offered.
2. Replay the same seeded arrival schedule (Poisson by default, ``--shape constant`` for
   evenly spaced arrivals) at each load multiple of C (default 0.74, 1.16, 2.0 and 4.0)
   against a fresh replica per policy, with the guard mounted in-process and the policy
   chosen by its config: ``always_admit``, ``concurrency_cap``, ``saturation``, ``gradient``,
   ``token_rate``, ``slo``. Below capacity (``--reference-loads``, default 0.5 and 0.8) the
   ``bare`` replica (no guard at all) runs next to ``slo``: there the guard must cost nothing.
3. One table (goodput, goodput / C, goodput ÷ bare, TTFT p50/p99, rejection rate, admitted
   requests that missed — on a gap —, the TTFT forecast's predicted ÷ actual from the guard's
   trace, wasted work) as markdown and JSON, and a plot of goodput / C per policy and load.
4. ``--fleet N``: every row goes through ``kvguard proxy`` in front of N replicas instead, C is
   N × one replica's, and the reference row is the ``always_admit`` proxy
   (:mod:`chaos.overload_fleet`).

Time scale. The sim stretches every GPU step by ``--time-scale`` K so the whole run fits a
2-core machine; every duration of the scenario (the class SLO, the run length, the warm-up and
the client timeout) is stretched by the same K, so the queueing dynamics are those of the GPU
at real speed. All times in the report are wall seconds at that scale; rates are per wall
second. The default workload is prefill-heavy (prompts 512-2048 tokens, answers 16-64): it
keeps the streamed-token rate low enough that the load generator is never the bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from chaos.admission_quality import forecast_error, gap_attribution
from chaos.cost_report import block_section, combine_blocks, has_cost, plot_cost
from chaos.load_cli import configure as configure_load
from chaos.load_cli import run_once
from chaos.overload_fleet import Fleet
from chaos.overload_plan import (
    FLEET_REFERENCE,
    POLICIES,
    REFERENCE_POLICIES,
    plan_runs,
    plan_sdk_runs,
    reference_policy,
)
from chaos.overload_table import (
    BARE,
    add_bare_ratios,
    fmt_num,
    plot_goodput,
    render_cache_table,
    render_table,
    row_from_run,
)
from chaos.replica import (
    REPLICA_SERVERS,
    ReplicaProcess,
    exit_on_sigterm,
    wait_idle,
    write_guard_config,
)
from chaos.report import read_records
from chaos.schedule import LengthDist
from chaos.sdk_column import require_user_runner, sdk_row
from chaos.sweep import SweepPoint, capacity, sweep_rates
from chaos.workloads import add_workload_args, workload_args, workload_from_args
from policies.cost import RequestClass

__all__ = ["configure", "configure_scenario", "run", "POLICIES", "REFERENCE_POLICIES", "Scenario",
           "fmt_num", "probe_saturation", "policy_params", "render_table", "row_from_run",
           "run_policy", "plan_runs", "plan_sdk_runs"]



class Scenario:
    """The scaled scenario every run of one bench shares (model, SLO, lengths, timing)."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if args.num_blocks is not None and args.num_blocks < 1:
            raise ValueError(f"--num-blocks must be >= 1, got {args.num_blocks}")
        self.args = args
        self.scale = args.time_scale
        self.request_class = RequestClass("interactive", args.ttft * self.scale,
                                          args.itl * self.scale)
        self.duration_s = args.duration * self.scale
        self.warmup_s = args.warmup * self.scale
        self.timeout_s = args.client_timeout * self.scale
        self.prompt = LengthDist.parse(args.prompt_tokens)
        self.output = LengthDist.parse(args.output_tokens)

    def engine_args(self) -> list[str]:
        a = self.args
        return ["--model", a.model, "--backend", "sim", "--gpu", a.gpu,
                "--time-scale", repr(self.scale), "--max-num-seqs", str(a.max_num_seqs),
                "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                *(["--num-blocks", str(a.num_blocks)] if a.num_blocks is not None else []),
                "--http", a.replica_http,
                # the precise view subscribes to the replicas' KV-cache events
                *(["--kv-events-endpoint", "tcp://127.0.0.1:*"]
                  if getattr(a, "prefix_cache", "approximate") == "precise" else [])]

    def guard_settings(self, out: Path) -> dict:
        """Top-level guard keys of every row: the prefix-cache view (``--prefix-cache``).
        The precise view needs a tokenizer key; the bench's prompts are token ids, which the
        view hashes as sent, so a placeholder ``tokenizer.json`` (written to ``out``) is
        enough: it never tokenizes a prompt here."""
        mode = getattr(self.args, "prefix_cache", "approximate")
        if mode != "precise":
            return {}  # the guard's default view
        return {"prefix_cache": mode, "tokenizer": placeholder_tokenizer(out)}

    def load_args(self, url: str, rate: float, out: Path, duration_s: float | None = None,
                  warmup_s: float | None = None, shape: str | None = None,
                  step_traces: Sequence[str | Path] = ()) -> argparse.Namespace:
        """``kvguard load``'s arguments for one run; ``step_traces`` (the replicas' engine step
        traces) add the cost of its goodput window, priced as GPU time."""
        p = argparse.ArgumentParser()
        configure_load(p)
        c = self.request_class
        a = self.args
        cost = [arg for path in step_traces for arg in ("--step-trace", str(path))]
        if cost:
            cost += ["--engine-gpu", a.gpu, "--engine-model", a.model,
                     "--time-scale", repr(self.scale)]
        return p.parse_args([*cost,
            "--url", url, "--rate", repr(rate), "--shape", shape or self.args.shape,
            "--duration", repr(duration_s or self.duration_s),
            "--warmup", repr(self.warmup_s if warmup_s is None else warmup_s),
            "--prompt-tokens", self.args.prompt_tokens,
            "--output-tokens", self.args.output_tokens, *workload_args(self.args),
            "--class", c.name, "--ttft", repr(c.ttft_s), "--itl", repr(c.itl_s),
            "--seed", str(self.args.seed), "--timeout", repr(self.timeout_s),
            "--drain-timeout", repr(self.timeout_s), "--out", str(out), "--quiet"])

    def mean_request_tokens(self) -> float:
        workload = workload_from_args(self.args)
        extra = getattr(workload, "prefix_tokens", 0) or getattr(workload, "system_tokens", 0)
        return _mean(self.prompt) + _mean(self.output) + extra


def placeholder_tokenizer(out: Path) -> str:
    """A one-word ``tokenizer.json`` in ``out`` (for configs that need a tokenizer key while
    every prompt is sent as token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = out / "tokenizer.json"
    if not path.exists():
        tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return str(path)


def _mean(dist: LengthDist) -> float:
    return (dist.low + dist.high) / 2 if dist.kind != "lognormal" else float(dist.median)


def configure_scenario(p: argparse.ArgumentParser, out_default: str) -> None:
    """The scenario's flags (replica, traffic, SLO, seed, output folder)."""
    p.add_argument("--model", default="llama-7b",
                   help="model preset of the sim replicas")
    p.add_argument("--gpu", default="h100-80g",
                   help="GPU profile of the sim replicas")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="stretch every GPU step (and every scenario time) by this factor")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="each sim replica's sequence slots")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="prefill chunk: 1024 keeps a mixed step near 35 ms on an H100, "
                        "inside the 80 ms ITL limit")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks of the replica (default: what the GPU's memory holds); "
                        "a small pool makes the replica KV-bound")
    p.add_argument("--replica-http", choices=REPLICA_SERVERS,
                   default="h11", help="the replicas' HTTP server (`kvguard engine --http`; "
                   "default h11, the one every table in docs/benchmarks.md was measured on)")
    p.add_argument("--prompt-tokens", default="512:2048",
                   help="prompt tokens per request (MIN:MAX)")
    p.add_argument("--output-tokens", default="16:64",
                   help="output tokens per request (MIN:MAX)")
    add_workload_args(p)
    p.add_argument("--ttft", type=float, default=1.0, help="class TTFT limit, GPU seconds")
    p.add_argument("--itl", type=float, default=0.08, help="class ITL limit, GPU seconds")
    p.add_argument("--duration", type=float, default=16.0, help="run length, GPU seconds")
    p.add_argument("--warmup", type=float, default=3.0, help="left out of goodput, GPU s")
    p.add_argument("--client-timeout", type=float, default=6.0,
                   help="clients give up after this many GPU seconds")
    p.add_argument("--shape", choices=("poisson", "constant"), default="poisson",
                   help="arrival process of every run (the capacity probe is fixed)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed")
    p.add_argument("--out", default=None, help=f"output folder (default {out_default})")


def configure(p: argparse.ArgumentParser) -> None:
    configure_scenario(p, "runs/overload-<time>")
    p.add_argument("--loads", default="0.74,1.16,2.0,4.0", help="multiples of capacity C")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"policies at --loads ({BARE!r}: the replica with no guard)")
    p.add_argument("--reference-loads", default="0.5,0.8",
                   help="multiples of C below capacity, run with --reference-policies "
                        "('' for none)")
    p.add_argument("--reference-policies", default=None,
                   help=f"default {','.join(REFERENCE_POLICIES)}; with --fleet "
                        f"{FLEET_REFERENCE},slo")
    p.add_argument("--sdk-loads", default=None,
                   help="loads at which the same arrivals are replayed as users on the OpenAI "
                        "SDK (default retries) for --sdk-policies ('' for none; default 2.0, "
                        "none with --fleet)")
    p.add_argument("--sdk-policies", default="always_admit,slo",
                   help="policies the OpenAI-SDK rows run with (comma-separated)")
    p.add_argument("--sweep", default="0.8:1.6:0.1",
                   help="capacity sweep, multiples of the saturation throughput S")
    p.add_argument("--capacity", type=float, default=None,
                   help="skip the probe and sweep; use this C (req/s at this time scale; "
                        "per replica with --fleet)")
    p.add_argument("--prefix-cache", choices=("approximate", "precise"), default="approximate",
                   help="the guard's prefix-cache view in every row (default approximate; "
                        "precise: fed by the replicas' KV-cache events)")
    p.add_argument("--fleet", type=int, default=0, metavar="N",
                   help="run every row through `kvguard proxy` in front of N sim replicas "
                        "(C = N x one replica's; the reference row is always_admit) instead "
                        "of one replica with the guard in-process")
    p.add_argument("--envoy-max-requests", type=int, default=None, metavar="M",
                   help="the envoy_circuit_breaker row's max_requests (and max_connections) "
                        "over the fleet; that row needs it (find it with a short sweep of M "
                        "at the bench's load)")


def probe_saturation(scenario: Scenario, url: str, out: Path, num_requests: int = 48) -> float:
    """Completions per second of a replica whose queue never runs dry.

    A closed burst of ``num_requests`` (all sent within 0.2 s) gives a first, low estimate S0
    (its ramp-down tail runs at small batches). Then open-loop arrivals at 2 × S0 keep the
    queue growing for ``scenario.duration_s``; the completions that land in the second half of
    that period, divided by its length, are the saturation throughput.
    """
    burst = scenario.load_args(url, num_requests / 0.2, out / "burst", duration_s=0.2,
                               warmup_s=0.0, shape="constant")
    burst.timeout = burst.drain_timeout = 600.0
    rough = _completion_rate(burst, out / "burst", None)
    wait_idle(url)
    flood = scenario.load_args(url, 2.0 * rough, out / "flood", shape="constant")
    flood.timeout, flood.drain_timeout = 3.0 * scenario.duration_s, 1.0  # then cancel the rest
    return _completion_rate(flood, out / "flood", (scenario.duration_s / 2, scenario.duration_s))


def _completion_rate(args: argparse.Namespace, out: Path,
                     window_s: tuple[float, float] | None) -> float:
    """Completions per second of one run: inside ``window_s`` (run-relative completion times),
    or over the whole run from the first send to the last completion."""
    run_once(args, args.rate, out, None)
    records = read_records(out / "requests.jsonl")
    ends = [r.sent_s + r.e2e_s for r in records
            if r.successful and r.e2e_s is not None and r.sent_s is not None]
    if window_s is None:
        start_s = min((r.sent_s for r in records if r.sent_s is not None), default=0.0)
        lo_s, hi_s = start_s, max(ends, default=start_s)
    else:
        lo_s, hi_s = window_s
    num = sum(lo_s <= t < hi_s for t in ends)
    if num < 8 or hi_s <= lo_s:
        raise RuntimeError(f"saturation probe: only {num} requests completed; see {out}")
    return num / (hi_s - lo_s)


def measure_capacity(scenario: Scenario, out: Path, log) -> tuple[float, float, list[dict]]:
    """(S, C, sweep points) on one plain replica (no guard: the engine's own queue)."""
    with ReplicaProcess.start(scenario.engine_args()) as replica:
        sat = probe_saturation(scenario, replica.base_url, out / "probe")
        log(f"saturation throughput S = {sat:.2f} req/s")
        points = []
        for rate in sweep_rates(scenario.args.sweep, sat):
            wait_idle(replica.base_url)
            run_dir = out / f"sweep-{rate:.2f}"
            summary = run_once(scenario.load_args(replica.base_url, rate, run_dir), rate,
                               run_dir, None)
            t = summary["goodput"]["total"]
            points.append(SweepPoint(rate, t["num_offered"], t["offered_per_s"],
                                     t["completed_per_s"], t["goodput_per_s"]["strict"],
                                     t["goodput_ratio"]["strict"], str(run_dir)))
            log(f"  sweep {rate:6.2f} req/s: goodput {t['goodput_per_s']['strict']:.2f} req/s "
                f"({100 * (t['goodput_ratio']['strict'] or 0):.0f}% of offered)")
    cap = capacity(points)
    if cap is None:
        raise RuntimeError("no sweep rate kept goodput >= 90% of offered: lower --sweep")
    if cap == points[-1].rate_per_s:
        log(f"WARNING: the top of the sweep still kept goodput >= 90%: C >= {cap:.2f} is a "
            "lower bound; raise --sweep")
    return sat, cap, [p.to_dict() for p in points]


def policy_params(name: str, scenario: Scenario, cap_rps: float) -> dict:
    """Each baseline as an operator would deploy it: its documented defaults, except the
    token-rate limit, which needs a number — set at the measured capacity, in tokens/minute."""
    if name == "token_rate":
        return {"tokens_per_minute": int(cap_rps * scenario.mean_request_tokens() * 60)}
    return {}


def run_policy(scenario: Scenario, policy: str | None, rate: float, cap_rps: float,
               out: Path) -> dict:
    """One fresh replica with the guard (``policy``; None: no guard at all) mounted, one
    open-loop run at ``rate``. Returns the table row."""
    out.mkdir(parents=True, exist_ok=True)
    engine_trace = out / "engine-trace.jsonl"
    steps = out / "steps.jsonl"
    engine_args = [*scenario.engine_args(), "--trace", str(engine_trace), "--step-trace",
                   str(steps)]
    trace = out / "guard-trace.jsonl"
    if policy is not None and policy != BARE:
        c = scenario.request_class
        config = write_guard_config(str(out / "guard.toml"), policy=policy, ttft_s=c.ttft_s,
                                    itl_s=c.itl_s, trace_path=str(trace),
                                    policy_params=policy_params(policy, scenario, cap_rps),
                                    settings=scenario.guard_settings(out.parent))
        engine_args += ["--guard", config]
    with ReplicaProcess.start(engine_args) as replica:
        summary = run_once(scenario.load_args(replica.base_url, rate, out, step_traces=[steps]),
                           rate, out, None)
    row = row_from_run(summary, read_records(out / "requests.jsonl"), scenario, cap_rps)
    row["cost"] = summary.get("cost")
    warmup_s = summary["goodput"]["window_s"][0]
    row["forecast"] = forecast_error(trace, (warmup_s, float("inf")))
    row["gaps"] = gap_attribution((trace, engine_trace, out / "requests.jsonl"),
                                  scenario.request_class.itl_s)
    return row


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    scenario = Scenario(args)
    runs = plan_runs(args)
    sdk_runs = set(plan_sdk_runs(args))
    if sdk_runs:
        require_user_runner()
    out = Path(args.out or f"runs/overload-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"kvguard bench overload: {args.model} on {args.gpu} (sim, time scale {scenario.scale}); "
        f"SLO TTFT {scenario.request_class.ttft_s:g} s, ITL {scenario.request_class.itl_s:g} s "
        f"(wall), {args.shape} arrivals; output in {out}")
    if args.capacity:
        sat, cap, sweep = None, args.capacity, []
    else:
        sat, cap, sweep = measure_capacity(scenario, out, log)
    log(f"capacity C = {cap:.2f} req/s")
    fleet = Fleet(scenario, args.fleet, out) if args.fleet else None
    if fleet is not None:
        cap *= args.fleet
        log(f"fleet: kvguard proxy in front of {args.fleet} replicas, C = {cap:.2f} req/s")
    rows = []
    with fleet or contextlib.nullcontext():
        for load, policy in runs:
            log(f"load {load:.2f} × C = {load * cap:.2f} req/s, policy {policy} ...")
            run_dir = out / f"{policy}-{load:.2f}"
            if fleet is not None:
                row = fleet.run_policy(policy, load * cap, cap, run_dir,
                                       policy_params(policy, scenario, cap))
            else:
                row = run_policy(scenario, policy, load * cap, cap, run_dir)
            log(f"  goodput {row['goodput_rps']:.2f} req/s = {row['goodput_over_c']:.2f} C, "
                f"rejected {100 * row['rejected_ratio']:.0f}%")
            if (load, policy) in sdk_runs:
                row["sdk"] = sdk_row(scenario, policy, load * cap, cap, Path(f"{run_dir}-sdk"),
                                     policy_params(policy, scenario, cap))
                log(f"  OpenAI SDK users: {row['sdk']['attempts_per_user'] or 0:.2f} attempts "
                    f"each, user goodput {row['sdk']['goodput_over_c']:.2f} C")
            rows.append({"load": load, "policy": policy, **row})
    _report(args, out, rows, sat, cap, sweep, log)
    return 0


def row_costs(rows: Sequence[dict]) -> dict:
    """One cost block over the rows: each row's goodput window, labelled policy @ load."""
    return combine_blocks([(f"{r['policy']} @ {r['load']:g} C", r.get("cost")) for r in rows])


def _report(args, out: Path, rows: list[dict], sat, cap: float, sweep, log) -> None:
    """The table (markdown and JSON) and the plot."""
    rows.sort(key=lambda r: r["load"])  # stable: each load's policies keep their run order
    reference = reference_policy(args)
    add_bare_ratios(rows, reference)
    table = render_table(rows, reference)
    cache_table = render_cache_table(rows)
    if cache_table is not None:
        table += "\n\nPrefix caches:\n\n" + cache_table
    plot_goodput(rows, out / "overload.png")
    cost = row_costs(rows)
    if has_cost(cost):
        plot_cost(cost["windows"], out / "cost.png")
    result = {"command": " ".join(["kvguard", "bench", "overload", *sys.argv[3:]]),
              "scenario": {k: v for k, v in vars(args).items()},
              "saturation_rps": sat, "capacity_rps": cap, "sweep": sweep, "rows": rows}
    (out / "overload.json").write_text(json.dumps(result, indent=1))
    fleet = f" ({args.fleet} replicas behind kvguard proxy)" if args.fleet else ""
    (out / "overload.md").write_text(
        f"# kvguard bench overload{fleet}\n\nS = {fmt_num(sat)} req/s, C = {cap:.2f} req/s\n\n"
        f"{table}\n\n![goodput](overload.png)\n\n" + "\n".join(block_section(cost)))
    log("\n" + table)
    log(f"\nreport: {out / 'overload.md'}  plot: {out / 'overload.png'}")
