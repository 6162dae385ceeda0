"""Inter-token gap attribution from the per-token delivery records of the request traces.

The engine trace (``engine/trace.py``) carries, per streamed token,
``[batch_id, step_start_s, step_end_s, handed_s, written_s]``; the guard trace may carry
``chunks_s``, when its relay forwarded each content chunk. Each token's path splits into stages:

==============  =========================================================================
step            the engine step that produced the token (step start → step end)
between_steps   the previous token's step end → this token's step start: engine-thread work
                between steps, and any whole step this sequence sat out
loop            step end → the event loop handed the token to the response (engine thread →
                loop hand-off, loop busy with other work)
write           handed → the server's send of its chunk returned (detokenize, format, send)
relay           written → the guard forwarded the chunk (the hop and the relay; ~0 when the
                guard is mounted in-process, whose relay runs inside the server's send),
                above the request's smallest such delay, so the two processes' clocks need
                not agree
client          the client's own gap (``itl_s`` of a ``kvguard load`` record) minus the gap
                the last server-side hop saw: the socket, the client's loop and its parser
==============  =========================================================================

Each token's ``batch_id`` also shows whether the request sat out an engine step between two of
its tokens (consecutive steps have consecutive batch ids): the scheduler's stall-free rule says
a running decode never does.

A gap between tokens ``i-1`` and ``i`` as the last recorded hop saw it telescopes exactly into
``between_steps(i) + step(i) + Δloop + Δwrite + Δrelay + client`` where ``Δx = x(i) - x(i-1)``:
every term is a difference within one process's record, so clocks of different processes
never need to agree. Only gaps over the limit are attributed; the per-stage table covers every
token (``client`` has no per-token latency, only its part of each gap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DELIVERY_STAGES", "Gap", "token_stages_s", "request_gaps", "summarize_delivery",
           "render_delivery"]

DELIVERY_STAGES = ("step", "between_steps", "loop", "write", "relay", "client")
_NUM_WORST = 10


@dataclass(frozen=True)
class Gap:
    """One inter-token gap and its parts, in seconds (``relay`` None without guard chunks)."""

    request_id: str
    index: int  # the later token's index in the stream (>= 1)
    gap_s: float
    parts_s: dict[str, float | None]
    num_steps_sat_out: int = 0  # engine steps between the two tokens' steps (0: back to back)


def _relay_times(engine_line: dict, guard_line: dict | None) -> list[float] | None:
    """The guard's forward time per token, when its chunks map one to one onto the tokens."""
    if guard_line is None:
        return None
    chunks = guard_line.get("chunks_s")
    tokens = engine_line.get("tokens") or []
    return chunks if isinstance(chunks, list) and len(chunks) == len(tokens) else None


def token_stages_s(engine_line: dict, guard_line: dict | None = None) -> list[dict]:
    """Per token: each stage's latency in seconds (None where a timestamp is missing)."""
    tokens = engine_line.get("tokens") or []
    relayed = _relay_times(engine_line, guard_line) or [None] * len(tokens)
    hops = [_diff(forwarded, t[4]) for forwarded, t in zip(relayed, tokens, strict=True)]
    least_hop = min((h for h in hops if h is not None), default=None)
    rows = []
    for i, (_, start, end, handed, written) in enumerate(tokens):
        previous_end = tokens[i - 1][2] if i else None
        rows.append({"step": _diff(end, start), "between_steps": _diff(start, previous_end),
                     "loop": _diff(handed, end), "write": _diff(written, handed),
                     "relay": _diff(hops[i], least_hop)})
    return rows


def _client_gaps(engine_line: dict, client_line: dict | None) -> list[float] | None:
    """The client's gap before each token after the first, when they map one to one."""
    if client_line is None:
        return None
    gaps = client_line.get("itl_s")
    tokens = engine_line.get("tokens") or []
    return gaps if isinstance(gaps, list) and len(gaps) == len(tokens) - 1 else None


def request_gaps(engine_line: dict, guard_line: dict | None = None,
                 client_line: dict | None = None) -> list[Gap]:
    """Every inter-token gap of one request (as the client saw it when its record maps onto
    the tokens, else as the last server-side hop did), with its parts."""
    tokens = engine_line.get("tokens") or []
    relayed = _relay_times(engine_line, guard_line)
    seen = relayed if relayed is not None else [t[4] for t in tokens]
    client = _client_gaps(engine_line, client_line)
    stages = token_stages_s(engine_line, guard_line)
    gaps = []
    for i in range(1, len(tokens)):
        server_gap_s = _diff(seen[i], seen[i - 1])
        if server_gap_s is None:
            continue
        gap_s = server_gap_s if client is None else client[i - 1]
        now, before = stages[i], stages[i - 1]
        parts = {"step": now["step"], "between_steps": now["between_steps"],
                 "loop": _diff(now["loop"], before["loop"]),
                 "write": _diff(now["write"], before["write"]),
                 "relay": _diff(now["relay"], before["relay"]),
                 "client": None if client is None else gap_s - server_gap_s}
        sat_out = max(tokens[i][0] - tokens[i - 1][0] - 1, 0)  # batch ids count every step
        gaps.append(Gap(engine_line["request_id"], i, gap_s, parts, sat_out))
    return gaps


def summarize_delivery(rows: list[tuple[dict | None, dict | None]], default_limit_s: float,
                       percentile: Callable[[list[float], float], float],
                       clients: dict[str, dict] | None = None) -> dict | None:
    """Per-stage p50/p99/max (ms) over every token, and the attribution of the gaps over each
    request's limit (the guard line's ``itl_limit_s``, else ``default_limit_s``). ``clients``:
    client records by request id. None when no engine line carries token records."""
    per_stage: dict[str, list[float]] = {k: [] for k in DELIVERY_STAGES}
    num_gaps, num_sat_out, over, clients = 0, 0, [], clients or {}
    for guard_line, engine_line in rows:
        if engine_line is None or not engine_line.get("tokens"):
            continue
        for token in token_stages_s(engine_line, guard_line):
            for stage, value in token.items():
                if value is not None:
                    per_stage[stage].append(value * 1e3)
        limit_s = (guard_line or {}).get("itl_limit_s") or default_limit_s
        gaps = request_gaps(engine_line, guard_line, clients.get(engine_line["request_id"]))
        num_gaps += len(gaps)
        num_sat_out += sum(1 for g in gaps if g.num_steps_sat_out)
        over += [g for g in gaps if g.gap_s > limit_s]
    if not num_gaps and not per_stage["step"]:
        return None
    stages = {stage: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99),
                      "max_ms": max(v)} for stage, v in per_stage.items() if v}
    return {"stages": stages, "num_gaps": num_gaps, "num_over_limit": len(over),
            "num_gaps_after_a_step_sat_out": num_sat_out,
            "default_limit_ms": default_limit_s * 1e3, **_attribution(over)}


def _attribution(over: list[Gap]) -> dict:
    """Sum of each part over the gaps over the limit, which part dominated each, the worst."""
    sums_ms = dict.fromkeys(DELIVERY_STAGES, 0.0)
    dominant = dict.fromkeys(DELIVERY_STAGES, 0)
    for gap in over:
        known = {k: v for k, v in gap.parts_s.items() if v is not None}
        for stage, value in known.items():
            sums_ms[stage] += value * 1e3
        dominant[max(known, key=known.get)] += 1
    worst = sorted(over, key=lambda g: g.gap_s, reverse=True)[:_NUM_WORST]
    return {"over_limit_ms": {"gap": sum(g.gap_s for g in over) * 1e3, **sums_ms},
            "dominant": dominant,
            "worst": [{"request_id": g.request_id, "index": g.index, "gap_ms": g.gap_s * 1e3,
                       "num_steps_sat_out": g.num_steps_sat_out,
                       **{k: None if v is None else v * 1e3 for k, v in g.parts_s.items()}}
                      for g in worst]}


def render_delivery(delivery: dict) -> list[str]:
    lines = ["", f"{'token stage':<14} {'n':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}"]
    for stage in DELIVERY_STAGES:
        row = delivery["stages"].get(stage)
        if row is not None:
            lines.append(f"{stage:<14} {row['n']:>7} {row['p50_ms']:>9.2f} {row['p99_ms']:>9.2f} "
                         f"{row['max_ms']:>9.2f}")
    total = delivery["over_limit_ms"]["gap"]
    lines.append(f"gaps over the limit: {delivery['num_over_limit']} of {delivery['num_gaps']} "
                 f"(limit: the class's, else {delivery['default_limit_ms']:.0f} ms); gaps "
                 f"across an engine step the request sat out: "
                 f"{delivery['num_gaps_after_a_step_sat_out']}")
    if not delivery["num_over_limit"]:
        return lines
    shares = ", ".join(f"{s} {delivery['over_limit_ms'][s] / total:.0%}" for s in DELIVERY_STAGES)
    lines.append(f"  share of their time: {shares}")
    counts = ", ".join(f"{s} {n}" for s, n in delivery["dominant"].items() if n)
    lines.append(f"  largest part: {counts}")
    lines.append(f"  {'request':<20} {'token':>5} {'gap ms':>8} "
                 + " ".join(f"{s[:8]:>8}" for s in DELIVERY_STAGES) + " sat out")
    for g in delivery["worst"]:
        cells = " ".join("       -" if g[s] is None else f"{g[s]:>8.1f}" for s in DELIVERY_STAGES)
        lines.append(f"  {g['request_id'][:20]:<20} {g['index']:>5} {g['gap_ms']:>8.1f} {cells} "
                     f"{g['num_steps_sat_out']:>7}")
    return lines


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start
