"""Micro-benchmark: median ``decide()`` time per policy on a 4-replica x 256-sequence snapshot.

Run: ``python -m chaos.bench.decide [--calls N]``. Two cases per policy:

* ``warm``: the same snapshot decided repeatedly (the guard re-deciding its queue against one
  state refresh; per-replica aggregates are cached on the snapshot after the first call);
* ``cold``: a new snapshot object every call (aggregates recomputed each time: the worst case);
* ``resv``: a new snapshot every call made with ``ReplicaSnapshot.with_reservations`` from one
  warmed engine state (the guard's path when only its reservations changed since the refresh).

The SLO policy also runs ``slo-kv-short``, where every replica is short of blocks, so each
decision also sorts the finish schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from policies import make_policy
from policies.cost import RequestClass, RequestCost
from policies.snapshot import LoadSnapshot, ReplicaSnapshot, SeqLoad
from policies.step_time import StepTimeModel

__all__ = ["main", "make_bench_snapshot"]

_CLASS = RequestClass("interactive", ttft_s=1.0, itl_s=0.08)
_STEP = StepTimeModel(
    base_s=0.004, per_prefill_token_s=2e-6, per_decode_seq_s=3e-5, per_context_token_s=2e-8
)


def make_bench_snapshot(
    num_free_blocks: int = 6000, num_replicas: int = 4, num_seqs: int = 256
) -> LoadSnapshot:
    running = tuple(
        SeqLoad(
            num_context_tokens=200 + 7 * i,
            num_prefill_tokens_remaining=0,
            num_remaining_output_tokens=1 + (37 * i) % 250,
            itl_s=0.08 if i % 2 else None,
        )
        for i in range(num_seqs)
    )
    waiting = tuple(SeqLoad(0, 300 + 50 * i, 128) for i in range(4))
    replicas = tuple(
        ReplicaSnapshot(
            replica_id=f"r{k}",
            observed_s=0.0,
            block_size=16,
            num_total_blocks=8000,
            num_free_blocks=num_free_blocks,
            max_num_seqs=512,
            max_num_batched_tokens=2048,
            max_model_len=4096,
            running=running,
            waiting=waiting,
            num_inflight=64,
        )
        for k in range(num_replicas)
    )
    return LoadSnapshot(now_s=0.5, replicas=replicas, step_time=_STEP)


def _cost(i: int) -> RequestCost:
    return RequestCost(f"q{i}", "acme", _CLASS, 512, 128, 64, 40, arrival_s=0.4, deadline_s=1.4)


def _fresh(snapshot: LoadSnapshot) -> LoadSnapshot:
    return dataclasses.replace(
        snapshot, replicas=tuple(dataclasses.replace(r) for r in snapshot.replicas)
    )


def _reserved(snapshot: LoadSnapshot, i: int) -> LoadSnapshot:
    seq = SeqLoad(0, 512, 64, itl_s=0.08)
    replicas = tuple(
        r.with_reservations((seq,) * (i % 3), 40 * (i % 3), 64 + i % 3) for r in snapshot.replicas
    )
    return dataclasses.replace(snapshot, replicas=replicas)


def median_us(policy_name: str, snapshot: LoadSnapshot, num_calls: int, case: str) -> float:
    policy = make_policy(
        policy_name, **({"tokens_per_minute": 10**9} if policy_name == "token-rate" else {})
    )
    for r in snapshot.replicas:
        r.load  # noqa: B018  (warm the engine groups' sums)
    make = {
        "warm": lambda i: snapshot,
        "cold": lambda i: _fresh(snapshot),
        "resv": lambda i: _reserved(snapshot, i),
    }
    snapshots = [make[case](i) for i in range(num_calls)]
    times_ns = []
    for i, snap in enumerate(snapshots):
        cost = _cost(i)
        start = time.perf_counter_ns()
        policy.decide(cost, snap)
        times_ns.append(time.perf_counter_ns() - start)
    return statistics.median(times_ns) / 1000.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    cases = [
        (name, name, make_bench_snapshot())
        for name in (
            "slo",
            "always-admit",
            "concurrency-cap",
            "saturation",
            "gradient",
            "token-rate",
        )
    ]
    cases.append(("slo-kv-short", "slo", make_bench_snapshot(num_free_blocks=0)))
    header = f"{'policy':<16} {'warm_us':>8} {'resv_us':>8} {'cold_us':>8}"
    print(f"{header}   (median of {args.calls} decide() calls)")
    for label, name, snapshot in cases:
        row = [median_us(name, snapshot, args.calls, case) for case in ("warm", "resv", "cold")]
        print(f"{label:<16} " + " ".join(f"{us:8.1f}" for us in row))


if __name__ == "__main__":
    main()
