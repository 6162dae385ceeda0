"""``kvguard timeline TRACE...``: join guard and engine request traces into per-stage latencies.

Guard lines (``guard/observe/trace.py``, ``"source": "guard"``) and engine lines (``engine/trace.py``,
``"source": "engine"``) are joined on ``request_id`` (the ``x-request-id`` the guard sends
upstream). Each stage is a difference within one trace, so the two processes' clocks never
need to agree:

=============  ==========================================================================
guard_queue    guard arrival → dispatch (pricing, decision, admission queue)
waiting        engine arrival → first step that scheduled it (the engine's own queue)
prefill        first scheduled step → first token sampled
decode         first token → engine completion
delivery       the guard's dispatch → release, minus the engine's arrival → completion: the
               hop and the relay, both directions
total          guard arrival → release (or engine arrival → completion, engine-only lines)
=============  ==========================================================================

Prints p50/p90/p99 milliseconds per stage (``--json`` for machine-readable output). When the
engine trace carries per-token delivery records (streamed requests), it also prints the
per-token stage table and attributes every inter-token gap over the limit to engine step,
between steps, event-loop hand-off, server write, relay and — given the ``requests.jsonl`` of a
``kvguard load`` run (client records: ``itl_s`` and ``request_id``, no ``source``) — the client
(``guard/observe/token_gaps.py``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path

from guard.observe.token_gaps import render_delivery, summarize_delivery

__all__ = ["configure", "run", "load_sources", "load_traces", "join", "stage_ms", "summarize",
           "percentile", "STAGES"]

STAGES = ("guard_queue", "waiting", "prefill", "decode", "delivery", "total")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="guard and/or engine JSONL traces")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--itl-limit-ms", type=float, default=80.0,
                        help="inter-token gap limit for requests whose guard line names none "
                             "(default: %(default)s, the default class's)")


def run(args: argparse.Namespace) -> int:
    if not args.itl_limit_ms > 0:
        raise ValueError(f"--itl-limit-ms must be > 0, got {args.itl_limit_ms}")
    sources = load_sources(args.traces)
    rows = join(sources["guard"], sources["engine"])
    summary = summarize(rows)
    summary["num_joined"] = sum(1 for g, e in rows if g is not None and e is not None)
    summary["num_guard_only"] = sum(1 for g, e in rows if e is None)
    summary["num_engine_only"] = sum(1 for g, e in rows if g is None)
    summary["num_client_records"] = len(sources["client"])
    summary["delivery"] = summarize_delivery(rows, args.itl_limit_ms / 1e3, percentile,
                                             sources["client"])
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def load_traces(paths: Iterable[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(guard lines, engine lines) by request id; ValueError names a bad file and line."""
    sources = load_sources(paths)
    return sources["guard"], sources["engine"]


def load_sources(paths: Iterable[str]) -> dict[str, dict[str, dict]]:
    """``{"guard": ..., "engine": ..., "client": ...}``, each its lines by request id (client
    records without a request id are skipped); ValueError names a bad file and line."""
    sources: dict[str, dict[str, dict]] = {"guard": {}, "engine": {}, "client": {}}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read trace {path!r}: {exc.strerror}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request_id = record["request_id"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not a request trace line") from None
            source = record.get("source")
            kind = ("engine" if source == "engine" else
                    "client" if source is None and "itl_s" in record else "guard")
            if request_id is not None:
                sources[kind][request_id] = record
    return sources


def join(guard: dict[str, dict], engine: dict[str, dict]) -> list[tuple[dict | None, dict | None]]:
    ids = list(guard) + [i for i in engine if i not in guard]
    return [(guard.get(i), engine.get(i)) for i in ids]


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


def stage_ms(g: dict | None, e: dict | None) -> dict[str, float | None]:
    """One request's stages in milliseconds (None where the traces lack the timestamps)."""
    s: dict[str, float | None] = dict.fromkeys(STAGES)
    if g is not None:
        s["guard_queue"] = _diff(g.get("dispatch_s"), g.get("arrival_s"))
        s["total"] = _diff(g.get("completion_s"), g.get("arrival_s"))
    if e is not None:
        s["waiting"] = _diff(e.get("prefill_start_s"), e.get("arrival_s"))
        s["prefill"] = _diff(e.get("first_token_s"), e.get("prefill_start_s"))
        s["decode"] = _diff(e.get("completion_s"), e.get("first_token_s"))
        if g is None:
            s["total"] = _diff(e.get("completion_s"), e.get("arrival_s"))
    if g is not None and e is not None:
        outer = _diff(g.get("completion_s"), g.get("dispatch_s"))
        inner = _diff(e.get("completion_s"), e.get("arrival_s"))
        s["delivery"] = None if outer is None or inner is None else outer - inner
    return {k: None if v is None else v * 1000.0 for k, v in s.items()}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; ``values`` non-empty."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(rows: list[tuple[dict | None, dict | None]]) -> dict:
    per_stage: dict[str, list[float]] = {k: [] for k in STAGES}
    for g, e in rows:
        for stage, value in stage_ms(g, e).items():
            if value is not None:
                per_stage[stage].append(value)
    stages = {}
    for stage, values in per_stage.items():
        if values:
            stages[stage] = {"n": len(values), **{f"p{q}_ms": percentile(values, q) for q in (50, 90, 99)}}
    return {"num_requests": len(rows), "stages": stages}


def render(summary: dict) -> str:
    lines = [f"{'stage':<12} {'n':>6} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10}"]
    for stage in STAGES:
        row = summary["stages"].get(stage)
        if row is not None:
            lines.append(f"{stage:<12} {row['n']:>6} {row['p50_ms']:>10.2f} "
                         f"{row['p90_ms']:>10.2f} {row['p99_ms']:>10.2f}")
    lines.append(f"requests: {summary['num_requests']} (joined {summary.get('num_joined', 0)}, "
                 f"guard only {summary.get('num_guard_only', 0)}, "
                 f"engine only {summary.get('num_engine_only', 0)})")
    if summary.get("delivery"):
        lines += render_delivery(summary["delivery"])
    return "\n".join(lines)
