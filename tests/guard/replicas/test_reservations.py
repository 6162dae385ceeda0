"""guard.replicas.reservations + LoadState's incremental snapshots: equal to a rebuild from scratch."""

from hypothesis import given, settings
from hypothesis import strategies as st

from guard.replicas.load_state import LoadState
from guard.replicas.reservations import ReplicaReservations, Reservation, reserved_load
from policies.cost import RequestClass, RequestCost
from policies.replica_load import ReplicaLoad, SeqTotals
from policies.snapshot import ReplicaSnapshot
from policies.step_time import StepTimeModel

FAST = RequestClass("interactive", 1.0, 0.08, 0)
SLOW = RequestClass("batch", 30.0, 1.0, 2)
PRIOR = StepTimeModel(0.01, 1e-4, 1e-4, 1e-7)


def cost(request_id, klass=FAST, prompt=100, expected=20, blocks=10):
    return RequestCost(request_id, "t", klass, prompt, 60, expected, blocks, 0.0, 1.0)


def state(listed=(), block_size=16, free=6000):
    seqs = [{"request_id": rid, "num_prompt_tokens": 50, "num_output_tokens": 3,
             "max_tokens": 40, "num_context_tokens": 53, "num_prefill_tokens_remaining": 0,
             "num_blocks": 4} for rid in listed]
    return {"model": "m", "backend": "sim", "max_model_len": 4096, "block_size": block_size,
            "num_total_blocks": 7000, "num_free_blocks": free, "max_num_seqs": 256,
            "max_num_batched_tokens": 2048, "num_preemptions": 0, "step_count": 1, "now_s": 0.0,
            "running": seqs[:1], "waiting": seqs[1:], "iterations": [], "timing_model": None,
            "time_scale": 1.0}


def rebuilt(ls: LoadState, replica_id: str, held: dict, reported: set) -> ReplicaSnapshot:
    """The reference: the engine snapshot with every pending reservation summed from scratch."""
    base = ls._replicas[replica_id].base
    mine = {rid: (c, t) for rid, (rep, c, t) in held.items() if rep == replica_id}
    pending = [(c, t) for rid, (c, t) in mine.items() if rid not in reported]
    return base.with_reservations(tuple(reserved_load(c, t) for c, t in pending),
                                  sum(c.num_blocks for c, _ in pending), len(mine))


def test_totals_match_seq_totals_of_the_pending_loads():
    book = ReplicaReservations()
    costs = [cost("a"), cost("b", SLOW, prompt=37, expected=5, blocks=3), cost("c", prompt=1)]
    for c in costs:
        book.add(c.request_id, Reservation("r", c, 0.0))
    book.mark_reported("b")
    book.remove("c")
    loads = (reserved_load(costs[0], 0.0),)
    assert book.totals(16, 2048) == SeqTotals.of(loads, 16, 2048)
    assert book.totals(32, 2048) == SeqTotals.of(loads, 32, 2048)  # a new block size recounts
    assert (book.num_inflight, book.num_reserved_blocks) == (2, 10)
    book.remove("a")
    book.remove("b")
    assert book.totals(32, 2048) == SeqTotals.of((), 32, 2048) and book.num_inflight == 0


def test_with_reserved_equals_replica_load_of():
    engine = ReplicaSnapshot("r", 0.0, 16, 100, 90, 8, 512, 4096)
    reserved = SeqTotals.of((reserved_load(cost("a")), reserved_load(cost("b", SLOW))), 16, 512)
    assert engine.load.with_reserved(reserved) == ReplicaLoad.of(
        engine.load.running, engine.load.waiting, reserved)


def test_no_reservation_in_flight_means_the_engine_snapshot_itself():
    ls = LoadState(default_prior=PRIOR)
    base = ls.update_from_kvguard_state("r0", state(), 1.0)
    ls.reserve("r0", "a", cost("a"), 1.0)
    assert ls.replica_snapshot("r0").num_inflight == 1
    ls.release("a")
    assert ls.replica_snapshot("r0") is base


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(["r0", "r1"]), st.integers(0, 7),
                  st.sampled_from([FAST, SLOW]), st.integers(1, 300), st.integers(1, 40)),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("update"), st.sampled_from(["r0", "r1"]),
                  st.lists(st.integers(0, 7), max_size=3), st.sampled_from([16, 32])),
        st.tuples(st.just("snapshot"), st.sampled_from(["r0", "r1"])),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_incremental_snapshot_equals_rebuilt_from_scratch(ops):
    ls = LoadState(default_prior=PRIOR)
    for rid in ("r0", "r1"):
        ls.update_from_kvguard_state(rid, state(), 0.0)
    held: dict[str, tuple[str, RequestCost, float]] = {}  # id -> (replica, cost, reserved_s)
    reported: set[str] = set()
    for now_s, op in enumerate(ops, start=1):
        if op[0] == "reserve":
            _, replica_id, n, klass, prompt, blocks = op
            rid = f"g{n}"
            c = cost(rid, klass, prompt=prompt, expected=prompt % 17 + 1, blocks=blocks)
            ls.reserve(replica_id, rid, c, float(now_s))
            held.pop(rid, None)  # reserving a held id replaces it (at the end of the order)
            held[rid] = (replica_id, c, float(now_s))
            reported.discard(rid)
        elif op[0] == "release":
            rid = f"g{op[1]}"
            assert ls.release(rid) == (held.pop(rid, None) is not None)
            reported.discard(rid)
        elif op[0] == "update":
            _, replica_id, listed, block_size = op
            ids = [f"g{n}" for n in listed]
            ls.update_from_kvguard_state(replica_id, state(ids, block_size), float(now_s))
            reported |= {r for r in ids if r in held and held[r][0] == replica_id}
        for replica_id in ("r0", "r1"):
            got = ls.replica_snapshot(replica_id)
            want = rebuilt(ls, replica_id, held, reported)
            assert got == want and got.load == want.load
            assert ls.num_inflight(replica_id) == want.num_inflight
            assert ls.num_reserved_blocks(replica_id) == want.num_reserved_blocks
        assert ls.snapshot(float(now_s)).replicas == tuple(
            ls.replica_snapshot(r) for r in ("r0", "r1"))
