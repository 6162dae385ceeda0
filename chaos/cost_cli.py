"""``kvguard cost``: a run's cost per window, recomputed offline from its traces and a config.

    kvguard cost --config guard.toml --guard-trace guard.jsonl \\
        --step-trace r0-steps.jsonl --step-trace r1-steps.jsonl \\
        --engine-trace r0.jsonl --engine-trace r1.jsonl --interval 10 --out runs/cost

Fates (good / late / failed / canceled / rejected) come from the guard's trace (``met_slo``,
``outcome``); each replica's engine steps from its ``--step-trace`` (one file per replica, in
replica order); output tokens from the engine request traces. Windows are seconds from the
first request's arrival, like the goodput window of ``kvguard load``. Each window's network is
the bytes on the guard trace's lines of the requests that arrived in it; whole-run totals
(``--network-bytes`` in its place, ``--energy-joules``) are spread over the windows by length.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from chaos.cost import Fleet, WorkWeights, format_usd, window_cost
from chaos.cost_inputs import (
    fates_from_guard_trace,
    output_tokens_from_engine_trace,
    read_jsonl,
    steps_from_lines,
)
from chaos.cost_report import cost_section, plot_cost
from chaos.goodput import Window
from guard.observe.cost_config import CostConfig

__all__ = ["configure", "run", "read_cost_config", "roofline_weights", "split_windows",
           "traced_bytes"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="guard TOML whose [cost] table prices the run "
                                    "(default: the built-in prices)")
    p.add_argument("--guard-trace", action="append", default=[], required=True,
                   help="guard request trace (repeatable: one per guard)")
    p.add_argument("--step-trace", action="append", default=[],
                   help="engine step trace, one per replica (kvguard engine --step-trace)")
    p.add_argument("--engine-trace", action="append", default=[],
                   help="engine request trace (output tokens per request)")
    p.add_argument("--replicas", type=int, help="provisioned replicas (default: one per "
                                                "--step-trace)")
    p.add_argument("--model", default="llama-7b",
                   help="model preset whose roofline weighs prefill, decode and KV read")
    p.add_argument("--network-bytes", type=int, default=0,
                   help="bytes in + out at the guard over the whole run, spread over the "
                        "windows by length (default 0: each window's from the guard trace's "
                        "per-request bytes, by arrival)")
    p.add_argument("--energy-joules", type=float, default=0.0,
                   help="the replicas' energy over the whole run (sum of their "
                        "kvguard_engine_energy_joules_total increases), priced at "
                        "[cost] energy_usd_per_kwh")
    p.add_argument("--window", help="START:END seconds from the first arrival "
                                    "(default: first arrival to the last step)")
    p.add_argument("--interval", type=float, help="split the window into windows of this many s")
    p.add_argument("--out", help="write cost.json, cost.md and cost.png here")


def roofline_weights(model: str, gpu: str) -> WorkWeights:
    """Work weights from the model's roofline on ``gpu`` (its linear step-time prior)."""
    from engine.config import model_preset
    from engine.gpus import get_gpu
    from engine.timing_model import TimingModel

    prior = TimingModel(model_preset(model), get_gpu(gpu)).as_step_time_prior()
    return WorkWeights.from_step_time_prior(prior)


def split_windows(start_s: float, end_s: float, interval_s: float | None) -> list[Window]:
    """``[start, end)`` cut into ``interval_s`` pieces (the last may be shorter)."""
    if interval_s is None:
        return [Window(start_s, end_s)]
    if not interval_s > 0 or not math.isfinite(interval_s):
        raise ValueError(f"--interval: must be a number of seconds > 0, got {interval_s}")
    edges = [start_s + i * interval_s for i in range(math.ceil((end_s - start_s) / interval_s))]
    return [Window(a, min(a + interval_s, end_s)) for a in edges]


def _parse_window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--window: expected START:END seconds, got {text!r}") from None
    return start, end


def read_cost_config(path: str | None) -> CostConfig:
    """The [cost] table of the guard TOML at ``path`` (the built-in prices for None)."""
    if path is None:
        return CostConfig()
    from guard.config import load_config

    return load_config(path, env={}).cost


def run(args: argparse.Namespace) -> int:
    config = read_cost_config(args.config)
    tokens: dict[str, int] = {}
    for path in args.engine_trace:
        tokens.update(output_tokens_from_engine_trace(read_jsonl(path)))
    guard_lines = [line for path in args.guard_trace for line in read_jsonl(path)]
    fates = fates_from_guard_trace(guard_lines, tokens)
    steps = [s for i, path in enumerate(args.step_trace)
             for s in steps_from_lines(read_jsonl(path), f"r{i}")]
    if not fates:
        raise ValueError("--guard-trace: no guard request lines")
    origin_s = min(f.arrival_s for f in fates)
    if args.window:
        start_s, end_s = _parse_window(args.window)
    else:
        start_s, end_s = 0.0, max([s.end_s for s in steps] + [f.arrival_s for f in fates]) - origin_s
    replicas = args.replicas if args.replicas is not None else len(args.step_trace)
    windows = split_windows(origin_s + start_s, origin_s + max(end_s, start_s + 1e-9),
                            args.interval)
    weights = roofline_weights(args.model, config.gpu)
    total_s = windows[-1].end_s - windows[0].start_s
    def network_bytes(w: Window) -> int:
        if args.network_bytes:
            return round(args.network_bytes * w.duration_s / total_s)
        return traced_bytes(guard_lines, w)

    results = [window_cost(w, steps, fates, config, Fleet(
        replicas, len(args.guard_trace), network_bytes=network_bytes(w),
        energy_j=args.energy_joules * w.duration_s / total_s), weights)
        for w in windows]
    dicts = [_relative(r.to_dict(), origin_s) for r in results]
    print("\n".join(cost_section(dicts, plot_name=None)))
    whole = sum(r.total_usd for r in results)
    print(f"total {format_usd(whole)} over {total_s:.3g} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cost.json").write_text(json.dumps({"windows": dicts}, indent=2) + "\n")
        (out / "cost.md").write_text("# kvguard cost\n\n" + "\n".join(cost_section(dicts)))
        plot_cost(dicts, out / "cost.png")
    return 0


def traced_bytes(lines, window: Window) -> int:
    """Bytes at the guard of the traced requests that arrived in ``window`` (request and
    response bodies, ``guard.observe.trace``; lines from before they were traced count 0)."""
    return sum((line.get("num_request_bytes") or 0) + (line.get("num_response_bytes") or 0)
               for line in lines if line.get("source") == "guard"
               and window.contains(float(line["arrival_s"])))


def _relative(d: dict, origin_s: float) -> dict:
    d["window_s"] = [round(d["window_s"][0] - origin_s, 6), round(d["window_s"][1] - origin_s, 6)]
    return d
