"""The single ``kvguard`` console script.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``.
The module is imported only when its subcommand runs, so ``import guard`` (and ``kvguard
--help``) never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

# name -> (module path, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.generate_cli", "stream a completion from the built-in engine"),
    "engine": ("engine.server_cli", "serve one engine replica (OpenAI-compatible HTTP)"),
    "plan": ("engine.plan_cli", "KV memory plan and serving roofline for a model on a GPU"),
    "proxy": ("guard.proxy.cli", "the standalone proxy in front of N replicas"),
    "fleet": ("chaos.fleet_cli", "start N sim replicas and proxies on loopback, stop on Ctrl-C"),
    "timeline": ("guard.observe.timeline", "join guard and engine traces into per-stage latencies"),
    "load": ("chaos.load_cli", "open-loop load test with a goodput report"),
    "bench": ("chaos.bench.cli", "benchmarks: engine, overload, guard overhead"),
    "chaos": ("chaos.chaos_cli", "game days: kill replicas, Redis and proxies under retrying "
                                 "clients; goodput verdicts"),
    "demo": ("chaos.demo", "the main job: a sim replica under a burst, with and without the guard"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard",
        description="kvguard: admission control and overload protection for LLM serving")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        _top_parser().parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kvguard {name}", description=SUBCOMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # configuration / input errors: one clear line, no traceback
        print(f"kvguard {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
