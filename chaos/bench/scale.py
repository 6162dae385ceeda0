"""``kvguard bench scale``: what one decider costs as the fleet grows, in-process.

For every replica count in ``--replicas`` and running-sequence count in ``--running`` it builds
a :class:`guard.replicas.load_state.LoadState` from synthetic ``/kvguard/state`` documents (one
per replica, ``running`` sequences each, loads varied across the fleet so replicas differ) and
measures:

* ``ingest_us``: one replica's document parsed from JSON bytes and applied
  (``serving.json_body.loads``, as the poller parses it, +
  ``LoadState.update_from_kvguard_state``), median wall time over the fleet; ``ingest_cpu_us`` the mean CPU time of one (the thread's
  CPU time over them all ÷ their count); ``state_cpu_share`` = ``ingest_cpu_us`` × replicas ×
  ``--refresh-hz`` ÷ 10⁶: the cores a decider spends keeping every replica's full document
  fresh (the HTTP round trip not counted). Cores come from the mean CPU time, not the median
  wall time: in the streamed deltas a step-time refit lands in about one refresh in six, which
  the median never sees, and a mean of wall times counts the waits of a preempted process;
  ``compact_*`` the same for the compact document the guard's poller asks for
  (``?compact=1&since_batch=N``: sequences as columns, no iteration sample seen before);
  ``stream_*`` the same for ``state_source = "stream"``: one delta of
  ``/kvguard/state/stream`` (5 decode steps for every running sequence, one finished, one
  started, one arrival, new iteration samples: a 10 Hz refresh of a busy replica) parsed,
  applied to the replica's groups and ingested;
* per policy, ``decide_p50_us`` / ``decide_p99_us``: ``policy.decide`` on the guard's own
  snapshot, the guard's path per request — every decision is followed by a reservation on the
  chosen replica and the release of the reservation made 8 decisions earlier, so each snapshot
  carries freshly changed reservations; ``snapshot_p50_us`` is ``LoadState.snapshot()`` itself
  (it re-ranks the replicas whose reservations changed), ``path_p50_us`` the two together.
  The garbage collector is off while a policy is timed (its pauses belong to the process).

``--learned-limit N`` stamps a learned concurrency limit of N (and a first-token time) on every
replica before anything is timed, as a proxy that has served requests has on each (its
``LearnedLimits``): the state refreshes then carry it (default 0: none, as a cold proxy).

``--gap-decisions N`` also decides N requests on each fleet with ``slo``'s bounded candidate
set and with its full scan side by side (:mod:`chaos.bench.candidate_gap`): how much worse the
bounded choice is.

``--json`` prints one JSON object with ``decide_p50_us`` (per policy) and ``state_cpu_share``
(the stream of deltas', what the proxy's default ``state_source = "auto"`` reads from a kvguard
replica; ``compact_state_cpu_share`` the polled compact document's, ``full_state_cpu_share``
the full one's) keyed by replica count (the largest ``--running`` for the per-replica-count
keys) and every row.
``--e2e-rate R`` runs end to end instead (:mod:`chaos.bench.scale_e2e`): R req/s through one
proxy in front of the largest ``--e2e-replicas`` state-only fleet at ``--time-scale``, and each
smaller fleet at the same offered ÷ C, with ``--json`` keys per fleet (``fleets``).
``--shed-flood`` floods one proxy in front of a saturated state-only fleet in wall time instead
(:mod:`chaos.bench.scale_flood`): the shed latency at ``--flood-rate`` req/s.
``--proxy-state-cpu`` measures a real idle proxy's CPU per streamed state event instead, in
front of state-only fleets of ``--replicas`` replicas each running ``--running`` sequences
(:mod:`chaos.bench.scale_proxy_state`).
Results and their commands go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

from chaos.bench import scale_e2e, scale_flood, scale_proxy_state
from chaos.bench.candidate_gap import candidate_gap
from engine.compact_state import compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import StreamStateSource
from policies import make_policy
from policies.cost import RequestClass, RequestCost
from policies.decision import Admit
from serving.json_body import loads
from serving.state_delta import StateDeltas
from serving.step_time_fit import StepTimeFit

__all__ = ["configure", "fleet_document", "run", "measure"]

POLICIES = ("slo", "always-admit", "concurrency-cap", "saturation", "gradient", "token-rate")
_CLASS = RequestClass("interactive", ttft_s=1.0, itl_s=0.08)
_NUM_IN_FLIGHT = 8  # reservations kept in flight while deciding


def fleet_document(index: int, num_running: int) -> dict:
    """Replica ``index``'s ``/kvguard/state``: ``num_running`` running sequences (their count
    and lengths varied by ``index`` so the fleet is not uniform), two waiting prompts."""
    num_seqs = max(0, num_running - index % 5)
    running = [
        {"request_id": f"r{index}-{i}", "num_prompt_tokens": 200, "num_output_tokens": i % 50,
         "max_tokens": 256, "num_context_tokens": 200 + 7 * i + index % 13,
         "num_prefill_tokens_remaining": 0, "num_blocks": 14 + i % 8, "num_cached_tokens": 0,
         "priority": 0}
        for i in range(num_seqs)
    ]
    waiting = [
        {"request_id": f"w{index}-{i}", "num_prompt_tokens": 300 + 50 * i + 10 * (index % 7),
         "num_output_tokens": 0, "max_tokens": 128, "num_context_tokens": 0,
         "num_prefill_tokens_remaining": 300 + 50 * i + 10 * (index % 7), "num_blocks": 0,
         "num_cached_tokens": 0, "priority": 0}
        for i in range(index % 3)
    ]
    return {
        "model": "sim", "backend": "sim", "max_model_len": 4096, "block_size": 16,
        "num_total_blocks": 8000, "num_free_blocks": 6000 - 37 * (index % 29),
        "max_num_seqs": 512, "max_num_batched_tokens": 2048, "num_preemptions": 0,
        "step_count": 10, "now_s": 0.0, "running": running, "waiting": waiting,
        "iterations": [{"batch_id": b, "num_prefill_tokens": 0, "num_decode_seqs": num_seqs,
                        "num_context_tokens": 200 * num_seqs, "duration_s": 0.02 + 1e-6 * b,
                        "end_s": 0.0} for b in range(4)],
        "timing_model": None, "time_scale": 1.0,
    }


def stream_events(index: int, num_running: int, num_events: int,
                  steps_per_event: int = 5) -> list[bytes]:
    """Replica ``index``'s ``/kvguard/state/stream`` events as sent to a guard (bytes after
    ``data: ``; the form it asks: the replica's step-time fit, no samples): its full
    document, then ``num_events`` deltas of ``steps_per_event`` decode steps each (a refresh
    at 10 Hz of a replica stepping every ~20 ms), in each of which one sequence finishes, one
    waiting prompt starts running and one new prompt arrives."""
    doc = fleet_document(index, num_running)
    encoder = StateDeltas("columns", StepTimeFit())
    events = [json.dumps(encoder.event(compact_state(doc))).encode()]
    for e in range(num_events):
        for seq in doc["running"]:
            seq["num_output_tokens"] += steps_per_event
            seq["num_context_tokens"] += steps_per_event
        if doc["running"]:
            doc["running"].pop(0)
        if doc["waiting"]:
            started = doc["waiting"].pop(0)
            started.update(num_context_tokens=started["num_prompt_tokens"],
                           num_prefill_tokens_remaining=0, num_output_tokens=1)
            doc["running"].append(started)
        doc["waiting"].append({"request_id": f"n{index}-{e}", "num_prompt_tokens": 400,
                               "num_output_tokens": 0, "max_tokens": 128,
                               "num_context_tokens": 0, "num_prefill_tokens_remaining": 400,
                               "num_blocks": 0, "num_cached_tokens": 0, "priority": 0})
        doc["num_free_blocks"] -= 3
        doc["step_count"] += steps_per_event
        last = doc["iterations"][-1]["batch_id"]
        doc["iterations"] = doc["iterations"][steps_per_event:] + [
            {**doc["iterations"][-1], "batch_id": last + 1 + s} for s in range(steps_per_event)]
        events.append(json.dumps(encoder.event(compact_state(doc))).encode())
    return events


def _stream_ingest_ns(load_state: LoadState, num_replicas: int, num_running: int,
                      num_events: int = 6) -> tuple[tuple[list[int], float], int]:
    """Each streamed delta's ns at the guard (and the mean CPU µs of one: :func:`_timed`):
    parsed, applied to the replica's groups, handed over and ingested
    (``LoadState.update_from_kvguard_state``); and a delta's bytes."""
    sources, streams = [], []
    for k in range(num_replicas):
        events = stream_events(k, num_running, num_events)
        source = StreamStateSource(f"http://r{k}")
        source.feed(json.loads(events[0]))
        load_state.update_from_kvguard_state(f"r{k}", source.take(), 0.0)
        sources.append(source)
        streams.append(events[1:])

    def apply(e_k: tuple[int, int]) -> None:
        e, k = e_k
        sources[k].feed(loads(streams[k][e]))
        load_state.update_from_kvguard_state(f"r{k}", sources[k].take(), 0.0)

    timed = _timed([(e, k) for e in range(num_events) for k in range(num_replicas)], apply)
    return timed, len(streams[0][-1])


def _timed(items: list, apply: Callable[[Any], None]) -> tuple[list[int], float]:
    """``apply`` on each item: each one's wall ns, and the mean CPU µs of one (the thread's
    CPU time over them all ÷ their count: a preempted call does not count the time it
    waited, as its wall time does on a busy machine)."""
    times_ns = []
    cpu_start = time.thread_time_ns()
    for item in items:
        start = time.perf_counter_ns()
        apply(item)
        times_ns.append(time.perf_counter_ns() - start)
    return times_ns, (time.thread_time_ns() - cpu_start) / len(items) / 1000.0


def _cost(i: int, now_s: float) -> RequestCost:
    return RequestCost(f"q{i}", "acme", _CLASS, 512, 128, 64, 40, arrival_s=now_s,
                       deadline_s=now_s + 1.0)


def _quantile_us(times_ns: list[int], q: float) -> float:
    ordered = sorted(times_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _fleet(num_replicas: int, num_running: int) -> tuple[LoadState, list[bytes], list[int]]:
    """A LoadState fed one document per replica, the documents, and each ingestion's ns."""
    load_state = LoadState(max_staleness_s=2.0)
    documents = [json.dumps(fleet_document(k, num_running)).encode()
                 for k in range(num_replicas)]
    times_ns = []
    for k, raw in enumerate(documents):
        start = time.perf_counter_ns()
        load_state.update_from_kvguard_state(f"r{k}", json.loads(raw), 0.0)
        times_ns.append(time.perf_counter_ns() - start)
    return load_state, documents, times_ns


def _decide_times(policy_name: str, load_state: LoadState, num_calls: int,
                  ) -> tuple[list[int], list[int]]:
    policy = make_policy(
        policy_name, **({"tokens_per_minute": 10**12} if policy_name == "token-rate" else {}))
    decide_ns, snapshot_ns = [], []
    now_s = 0.5
    for i in range(num_calls):
        cost = _cost(i, now_s)
        start = time.perf_counter_ns()
        snapshot = load_state.snapshot(now_s)
        mid = time.perf_counter_ns()
        decision = policy.decide(cost, snapshot)
        decide_ns.append(time.perf_counter_ns() - mid)
        snapshot_ns.append(mid - start)
        replica_id = decision.replica_id if isinstance(decision, Admit) else "r0"
        load_state.reserve(replica_id, cost.request_id, cost, now_s)
        if i >= _NUM_IN_FLIGHT:
            load_state.release(f"q{i - _NUM_IN_FLIGHT}")
    for i in range(max(0, num_calls - _NUM_IN_FLIGHT), num_calls):
        load_state.release(f"q{i}")
    return decide_ns, snapshot_ns


def measure(num_replicas: int, num_running: int, num_calls: int, refresh_hz: float,
            policies: tuple[str, ...] = POLICIES, num_gap_decisions: int = 0,
            learned_limit: int = 0) -> dict:
    """One row: ingestion and per-policy decision times for this fleet shape."""
    load_state, documents, _ = _fleet(num_replicas, num_running)
    if learned_limit:  # what LearnedLimits stamps on a replica once it has served requests
        for k in range(num_replicas):
            load_state.set_concurrency_limit(f"r{k}", learned_limit, 0.3)
    # ingestion again, warm (the first pass also registered each replica)
    ingest_ns, ingest_cpu_us = _timed(list(enumerate(documents)), lambda k_raw: (
        load_state.update_from_kvguard_state(f"r{k_raw[0]}", loads(k_raw[1]), 0.0)))
    compacts = [json.dumps(compact_state(json.loads(raw), since_batch=3)).encode()
                for raw in documents]
    compact_ns, compact_cpu_us = _timed(list(enumerate(compacts)), lambda k_raw: (
        load_state.update_from_kvguard_state(f"r{k_raw[0]}", loads(k_raw[1]), 0.0)))
    (stream_ns, stream_cpu_us), delta_bytes = _stream_ingest_ns(load_state, num_replicas,
                                                                 num_running)
    for k, raw in enumerate(compacts):  # the policies decide on the same fleet as before
        load_state.update_from_kvguard_state(f"r{k}", json.loads(raw), 0.0)
    row = {"replicas": num_replicas, "running": num_running,
           "document_bytes": len(documents[0]), "compact_bytes": len(compacts[0]),
           "delta_bytes": delta_bytes, "learned_limit": learned_limit, "policies": {}}
    for prefix, times_ns, cpu_us in (("", ingest_ns, ingest_cpu_us),
                                     ("compact_", compact_ns, compact_cpu_us),
                                     ("stream_", stream_ns, stream_cpu_us)):
        row[f"{prefix}ingest_us"] = round(_quantile_us(times_ns, 0.5), 1)
        row[f"{prefix}ingest_cpu_us"] = round(cpu_us, 1)
        row[f"{prefix}state_cpu_share"] = round(cpu_us * num_replicas * refresh_hz / 1e6, 4)
    for name in policies:
        gc.collect()
        gc.disable()  # a collection pause is the process's, not the decision's
        try:
            decide_ns, snapshot_ns = _decide_times(name, load_state, num_calls)
        finally:
            gc.enable()
        row["policies"][name] = {
            "decide_p50_us": round(_quantile_us(decide_ns, 0.5), 1),
            "decide_p99_us": round(_quantile_us(decide_ns, 0.99), 1),
            "snapshot_p50_us": round(_quantile_us(snapshot_ns, 0.5), 1),
            "path_p50_us": round(_quantile_us(
                [a + b for a, b in zip(decide_ns, snapshot_ns, strict=True)], 0.5), 1),
        }
    if num_gap_decisions:
        row["candidate_gap"] = candidate_gap(load_state, num_gap_decisions)
    return row


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="4,16,64,256",
                        help="comma-separated replica counts (default 4,16,64,256)")
    parser.add_argument("--running", default="64,256",
                        help="comma-separated running sequences per replica (default 64,256)")
    parser.add_argument("--calls", type=int, default=400, help="decisions per policy and shape")
    parser.add_argument("--refresh-hz", type=float, default=10.0,
                        help="state refreshes per replica per second, for state_cpu_share")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="policies to run (comma-separated)")
    parser.add_argument("--learned-limit", type=int, default=0,
                        help="stamp this learned concurrency limit on every replica, as a "
                             "proxy that has served requests has (default 0: none)")
    parser.add_argument("--gap-decisions", type=int, default=0,
                        help="also compare slo's candidate set with its full scan on N requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw decision µs and state cores against the replica count "
                             "(the largest --running) into this PNG (default: none)")
    scale_e2e.add_arguments(parser)
    scale_flood.add_arguments(parser)
    scale_proxy_state.add_arguments(parser)


def plot_scale(rows: list[dict], running: int, path: str) -> None:
    """Per policy decide p50/p99 and the path p50 (µs, log scale) and the state cores of each
    refresh mode, against the replica count, for the rows with ``running`` sequences."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted((r for r in rows if r["running"] == running), key=lambda r: r["replicas"])
    xs = [r["replicas"] for r in rows]
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name in rows[0]["policies"]:
        line, = left.plot(xs, [r["policies"][name]["decide_p50_us"] for r in rows], "o-",
                          label=f"{name} decide p50")
        if name == "slo":
            left.plot(xs, [r["policies"][name]["decide_p99_us"] for r in rows], "o:",
                      color=line.get_color(), label="slo decide p99")
            left.plot(xs, [r["policies"][name]["path_p50_us"] for r in rows], "s--",
                      color=line.get_color(), label="slo path p50 (snapshot + decide)")
    left.set(xscale="log", yscale="log", xlabel="replicas", ylabel="µs per request",
             title=f"one decision ({running} running per replica)")
    left.set_xticks(xs, [str(x) for x in xs])
    left.legend(fontsize=7)
    for key, label in (("state_cpu_share", "full document, polled"),
                       ("compact_state_cpu_share", "compact document, polled"),
                       ("stream_state_cpu_share", "stream of deltas")):
        right.plot(xs, [r[key] for r in rows], "o-", label=label)
    right.axhline(0.2, color="grey", linestyle=":", label="target 0.2 core")
    right.set(xscale="log", xlabel="replicas", ylabel="cores",
              title=f"keeping the state fresh at 10 Hz ({running} running per replica)")
    right.set_xticks(xs, [str(x) for x in xs])
    right.legend(fontsize=7)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _int_list(text: str, key: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{key}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{key}: at least one integer >= 1, got {text!r}")
    return values


def _run_e2e(args: argparse.Namespace) -> int:
    report = scale_e2e.run_e2e(args)
    print(json.dumps(report, indent=1) if args.json else scale_e2e.render(report))
    return 0


def _run_flood(args: argparse.Namespace) -> int:
    row = scale_flood.run_flood(args)
    print(json.dumps(row, indent=1) if args.json else scale_flood.render(row))
    return 0


def _run_proxy_state(args: argparse.Namespace) -> int:
    if args.shed_flood or args.e2e_rate is not None:
        raise ValueError("--proxy-state-cpu, --shed-flood and --e2e-rate: one at a time")
    # the in-process bench's own flags would do nothing here
    defaults = vars(_defaults())
    for key in ("calls", "policies", "learned_limit", "gap_decisions", "plot"):
        if getattr(args, key) != defaults[key]:
            raise ValueError(f"--{key.replace('_', '-')} does not apply to --proxy-state-cpu")
    if not args.refresh_hz > 0:
        raise ValueError("--refresh-hz must be > 0")
    report = scale_proxy_state.run_proxy_state(args, _int_list(args.replicas, "replicas"),
                                                _int_list(args.running, "running"))
    print(json.dumps(report, indent=1) if args.json else scale_proxy_state.render(report))
    return 0


def _defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args([])


def run(args: argparse.Namespace) -> int:
    if args.proxy_state_cpu:
        return _run_proxy_state(args)
    scale_proxy_state.refuse_without_proxy_state(args)
    if args.shed_flood:
        if args.e2e_rate is not None:
            raise ValueError("--shed-flood and --e2e-rate: one at a time")
        return _run_flood(args)
    scale_flood.refuse_without_flood(args)
    if args.e2e_rate is not None:
        return _run_e2e(args)
    scale_e2e.refuse_without_rate(args)
    replica_counts = _int_list(args.replicas, "replicas")
    running_counts = _int_list(args.running, "running")
    if args.calls < 1 or not args.refresh_hz > 0 or args.gap_decisions < 0 \
            or args.learned_limit < 0:
        raise ValueError("--calls must be >= 1, --refresh-hz > 0, --gap-decisions >= 0, "
                         "--learned-limit >= 0")
    policies = tuple(p for p in args.policies.split(",") if p)
    rows = [measure(n, r, args.calls, args.refresh_hz, policies, args.gap_decisions,
                    args.learned_limit)
            for r in running_counts for n in replica_counts]
    if args.plot:
        plot_scale(rows, max(running_counts), args.plot)
    if args.json:
        top = max(running_counts)
        by_count = {row["replicas"]: row for row in rows if row["running"] == top}
        print(json.dumps({
            "running": top,
            "decide_p50_us": {n: {p: v["decide_p50_us"] for p, v in row["policies"].items()}
                              for n, row in by_count.items()},
            # the proxy's default state_source ("auto") streams a kvguard replica's deltas
            "state_cpu_share": {n: row["stream_state_cpu_share"]
                                for n, row in by_count.items()},
            "stream_state_cpu_share": {n: row["stream_state_cpu_share"]
                                       for n, row in by_count.items()},
            # polled: the compact document (state_source = "kvguard"), and the full one
            "compact_state_cpu_share": {n: row["compact_state_cpu_share"]
                                        for n, row in by_count.items()},
            "full_state_cpu_share": {n: row["state_cpu_share"] for n, row in by_count.items()},
            "rows": rows,
        }, indent=1))
        return 0
    print(f"{'replicas':>8} {'running':>7} {'doc_B':>7} {'ingest_us':>9} {'state_cpu':>9} "
          f"{'cdoc_B':>7} {'c_ingest':>8} {'c_cpu':>7} {'delta_B':>7} {'s_ingest':>8} "
          f"{'s_cpu_us':>8} {'s_cpu':>7}  {'policy':<16} {'p50_us':>8} {'p99_us':>8} "
          f"{'snap_us':>8} {'path_us':>8}")
    for row in rows:
        for name, v in row["policies"].items():
            print(f"{row['replicas']:>8} {row['running']:>7} {row['document_bytes']:>7} "
                  f"{row['ingest_us']:>9} {row['state_cpu_share']:>9} {row['compact_bytes']:>7} "
                  f"{row['compact_ingest_us']:>8} {row['compact_state_cpu_share']:>7} "
                  f"{row['delta_bytes']:>7} {row['stream_ingest_us']:>8} "
                  f"{row['stream_ingest_cpu_us']:>8} "
                  f"{row['stream_state_cpu_share']:>7}  {name:<16} "
                  f"{v['decide_p50_us']:>8} {v['decide_p99_us']:>8} {v['snapshot_p50_us']:>8} "
                  f"{v['path_p50_us']:>8}")
        if "candidate_gap" in row:
            print(f"{row['replicas']:>8} {row['running']:>7}  candidate gap: {row['candidate_gap']}")
    return 0
