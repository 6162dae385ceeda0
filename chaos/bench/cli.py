"""``kvguard bench TARGET ...``: a thin dispatcher to the benchmark modules.

Each target module exposes ``configure(parser)`` and ``run(args) -> int`` and is imported only
when its target runs (``engine`` pulls in torch; ``guard`` must not).
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["TARGETS", "configure", "run"]

TARGETS: dict[str, tuple[str, str]] = {
    "engine": ("chaos.bench.engine", "engine throughput/latency (torch backend)"),
    "guard": ("chaos.bench.guard", "guard decision time and proxy overhead"),
    "sim": ("chaos.bench.sim", "the simulated backend against its timing model"),
    "overload": ("chaos.overload", "the reference overload, every policy side by side"),
    "proxy": ("chaos.bench.proxy", "kvguard proxy's added latency and shed rate vs LiteLLM"),
    "gateway": ("chaos.bench.gateway", "Envoy + kvguard epp vs Envoy alone, kvguard proxy, "
                                       "LiteLLM; EPP decisions/s"),
    "sheds": ("chaos.bench.sheds", "shed latency and event-loop lag under a 2,000 req/s flood"),
    "loadgen": ("chaos.bench.loadgen", "the load generator's own CPU per request, trivial server"),
    "shed-cost": ("chaos.bench.shed_cost", "CPU µs per shed in kvguard proxy's app, in-process"),
    "budget": ("chaos.bench.budget", "request rate with Redis / in-memory / no budgets"),
    "pricing": ("chaos.bench.pricing", "CPU time to price one chat request, in-process"),
    "serving": ("chaos.bench.serving", "what the connection limits cost: limited vs plain uvicorn"),
    "llamacpp": ("chaos.bench.llamacpp", "llama-cpp-python's server (SmolLM2) bare vs behind "
                 "kvguard proxy's defaults (a learned limit) at 0.5 / 1 / 4 x its capacity"),
    "scale": ("chaos.bench.scale", "decision and state-ingestion cost vs fleet size, in-process"),
    "state-cpu": ("chaos.bench.state_cpu", "a real proxy's CPU and state age in front of N "
                  "state-only replicas, per --state-source (polled vs streamed)"),
    "models": ("chaos.bench.models", "two models of different capacity behind one kvguard "
               "proxy: per-model goodput / C and misroutes"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in TARGETS.items()))
    parser.add_argument("target_args", nargs=argparse.REMAINDER,
                        help="arguments for the target (see kvguard bench TARGET --help)")


def _load(target: str):
    module_name = TARGETS[target][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ValueError(f"benchmark {target!r} is not available: module {module_name} "
                             "does not exist in this install") from None
        raise


def run(args: argparse.Namespace) -> int:
    module = _load(args.target)
    if args.target == "engine" and "--prefix" in args.target_args:  # prefix-cache TTFT
        module = importlib.import_module("chaos.bench.engine_prefix")
    parser = argparse.ArgumentParser(prog=f"kvguard bench {args.target}",
                                     description=TARGETS[args.target][1])
    module.configure(parser)
    return int(module.run(parser.parse_args(args.target_args)) or 0)
