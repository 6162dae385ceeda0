"""The single ``kvguard`` console script.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``.
The module is imported only when its subcommand runs, so ``import guard`` (and ``kvguard
--help``) never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

__all__ = ["main", "EXTRAS", "SUBCOMMANDS", "version"]

# name -> (module path, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.generate_cli", "stream a completion from the built-in engine"),
    "engine": ("engine.server_cli", "serve one engine replica (OpenAI-compatible HTTP)"),
    "plan": ("engine.plan_cli", "KV memory plan and serving roofline for a model on a GPU"),
    "proxy": ("guard.proxy.cli", "the standalone proxy in front of N replicas"),
    "epp": ("guard.epp.cli", "the endpoint picker of Envoy / the Gateway API (ext_proc gRPC)"),
    "fleet": ("chaos.fleet_cli", "start N sim replicas and proxies on loopback, stop on Ctrl-C"),
    "timeline": ("guard.observe.timeline", "join guard and engine traces into per-stage latencies"),
    "load": ("chaos.load_cli", "open-loop load test with a goodput report"),
    "cost": ("chaos.cost_cli", "a run's cost per window (good, wasted, idle) from its traces"),
    "review": ("chaos.review", "baseline vs candidate fleet over a scenario matrix: better, "
                               "no significant change or worse"),
    "bench": ("chaos.bench.cli", "benchmarks: engine, overload, guard overhead"),
    "chaos": ("chaos.chaos_cli", "game days: kill replicas, Redis and proxies under retrying "
                                 "clients; goodput verdicts"),
    "demo": ("chaos.demo", "the main job: a sim replica under a burst, with and without the guard"),
}

# The extra each subcommand needs beyond the guard-only install (``pip install kvguard``).
EXTRAS: dict[str, str] = {
    "generate": "engine", "engine": "engine", "plan": "engine", "epp": "gateway",
    "fleet": "bench", "load": "bench", "cost": "bench", "review": "bench", "bench": "bench",
    "chaos": "bench", "demo": "bench",
}
# What each extra installs that the guard alone does not (checked before the subcommand runs,
# so a missing extra is one line, not a traceback from deep inside the subcommand).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "starlette", "gguf", "jinja2"),
    "gateway": ("grpc", "grpc_health", "google.protobuf", "envoy"),
    "bench": ("torch", "starlette", "gguf", "jinja2", "matplotlib", "rich", "psutil", "openai"),
}


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvguard")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard",
        description="kvguard: admission control and overload protection for LLM serving")
    p.add_argument("--version", action="version", version=f"kvguard {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        extra = EXTRAS.get(name)
        sub.add_parser(name, add_help=False,
                       help=help_text + (f" [needs kvguard[{extra}]]" if extra else ""))
    return p


def _missing_module(name: str) -> str | None:
    """The first module the subcommand's extra installs that cannot be imported, if any."""
    for module in EXTRA_MODULES.get(EXTRAS.get(name, ""), ()):
        if sys.modules.get(module, False) is None or (
                module not in sys.modules and importlib.util.find_spec(module) is None):
            return module
    return None


def _import_subcommand(name: str):
    """The subcommand's module, or None after saying which extra is missing (one line)."""
    missing = _missing_module(name)
    if missing is not None:
        extra = EXTRAS[name]
        print(f"kvguard {name}: needs the '{extra}' extra ({missing} is not installed): "
              f"pip install 'kvguard[{extra}]'", file=sys.stderr)
        return None
    return importlib.import_module(SUBCOMMANDS[name][0])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        _top_parser().parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    module = _import_subcommand(name)
    if module is None:
        return 2
    parser = argparse.ArgumentParser(prog=f"kvguard {name}", description=SUBCOMMANDS[name][1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
