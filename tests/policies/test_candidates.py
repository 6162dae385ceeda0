"""The bounded candidate set: which replicas a decision forecasts, and that on small fleets
``slo`` decides among them exactly as its full scan does."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.candidates import RankedFleet, pick_candidates, rank_key
from policies.slo import SloPolicy
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot, QueuedAhead, ReplicaSnapshot, SeqLoad
from tests.policies.policy_builders import BATCH, INTERACTIVE, STEP, make_cost


def replica(rid: str, *, free: int = 100, running: int = 0, waiting_prompt: int = 0,
            observed_s: float = 0.0, healthy: bool = True, max_model_len: int = 512,
            total: int = 100) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        replica_id=rid, observed_s=observed_s, block_size=16, num_total_blocks=total,
        num_free_blocks=free, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=max_model_len,
        running=tuple(SeqLoad(32 + i, 0, 8 + i) for i in range(running)),
        waiting=(SeqLoad(0, waiting_prompt, 8),) if waiting_prompt else (),
        healthy=healthy)


def snapshot(replicas: tuple[ReplicaSnapshot, ...], *, ranked: bool,
             now_s: float = 0.1, ahead: QueuedAhead = NOTHING_AHEAD) -> LoadSnapshot:
    fleet = RankedFleet.of(replicas, STEP, now_s) if ranked else None
    return LoadSnapshot(now_s=now_s, replicas=replicas, step_time=STEP, fleet=fleet,
                        queued_ahead=ahead)


def test_rank_key_puts_the_idle_replica_before_the_busy_and_the_full_one_last():
    idle, busy, full = replica("a"), replica("b", running=6, waiting_prompt=200), replica(
        "c", free=0, running=2)
    fleet = RankedFleet.of((full, busy, idle), STEP)
    assert [r.replica_id for r in fleet.ranked] == ["a", "b", "c"]
    assert rank_key(full, STEP)[0] is True  # blocked for the reference request
    assert fleet.position == {"c": 0, "b": 1, "a": 2}


def test_ranked_fleet_leaves_out_unhealthy_replicas_but_keeps_their_limits():
    sick = replica("a", healthy=False, max_model_len=4096, total=500)
    fleet = RankedFleet.of((sick, replica("b")), STEP)
    assert [r.replica_id for r in fleet.ranked] == ["b"]
    assert (fleet.max_model_len, fleet.max_total_blocks) == (4096, 500)


def _fleet_of(n: int) -> RankedFleet:
    # rank order r0..r{n-1} (more prefill queued ranks worse); snapshot order reversed
    replicas = tuple(replica(f"r{i}", waiting_prompt=16 * i)
                     for i in reversed(range(n)))
    fleet = RankedFleet.of(replicas, STEP)
    assert [r.replica_id for r in fleet.ranked] == [f"r{i}" for i in range(n)]
    return fleet


def ids(replicas) -> list[str]:
    return [r.replica_id for r in replicas]


def test_a_small_fleet_is_wholly_the_candidate_set_in_snapshot_order():
    assert ids(pick_candidates(_fleet_of(5), 3, 2, turn=7)) == ["r4", "r3", "r2", "r1", "r0"]


def test_the_sampled_window_walks_the_rest_of_the_fleet_and_wraps():
    fleet = _fleet_of(10)  # best 3: r0-r2; the rest r3..r9 (7 replicas), 3 sampled per turn
    assert ids(pick_candidates(fleet, 3, 3, turn=0)) == ["r5", "r4", "r3", "r2", "r1", "r0"]
    assert ids(pick_candidates(fleet, 3, 3, turn=1)) == ["r8", "r7", "r6", "r2", "r1", "r0"]
    assert ids(pick_candidates(fleet, 3, 3, turn=2)) == ["r9", "r4", "r3", "r2", "r1", "r0"]
    seen = set()
    for turn in range(7):
        seen.update(ids(pick_candidates(fleet, 3, 3, turn)))
    assert seen == {f"r{i}" for i in range(10)}  # no replica starves


def test_without_sampling_only_the_best_are_candidates():
    assert ids(pick_candidates(_fleet_of(10), 2, 0, turn=3)) == ["r1", "r0"]


def test_a_large_fleet_admits_to_a_candidate_and_forecasts_no_other():
    replicas = tuple(replica(f"r{i}", running=6, waiting_prompt=200) for i in range(20)) + (
        replica("idle"),)
    policy = SloPolicy(num_candidates_best=1, num_candidates_sampled=0)
    decision = policy.decide(make_cost(), snapshot(replicas, ranked=True))
    assert decision.replica_id == "idle"


def test_no_fresh_candidate_falls_back_to_the_full_scan():
    # the best-ranked replica's state is stale: the full scan finds the fresh one
    stale = replica("stale", observed_s=-10.0)
    fresh = replica("fresh", running=3)
    policy = SloPolicy(num_candidates_best=1, num_candidates_sampled=0)
    decision = policy.decide(make_cost(), snapshot((stale, fresh), ranked=True))
    assert decision.replica_id == "fresh"


def test_a_request_no_candidate_can_hold_gets_the_full_scans_400():
    replicas = (replica("a", max_model_len=128), replica("b", max_model_len=128))
    cost = make_cost(prompt=200, max_tokens=32)
    assert SloPolicy().decide(cost, snapshot(replicas, ranked=True)) == SloPolicy().decide(
        cost, snapshot(replicas, ranked=False))
    assert SloPolicy().decide(cost, snapshot(replicas, ranked=True)).status == 400


def test_candidate_parameters_are_validated_by_name():
    for key, value in (("num_candidates_best", 0), ("num_candidates_sampled", -1),
                       ("num_candidates_best", True)):
        try:
            SloPolicy(**{key: value})
        except ValueError as exc:
            assert key in str(exc)
        else:
            raise AssertionError(f"{key}={value!r} accepted")


_replicas = st.lists(
    st.builds(
        dict,
        free=st.integers(0, 120),
        running=st.integers(0, 8),
        waiting_prompt=st.sampled_from([0, 0, 64, 300]),
        observed_s=st.sampled_from([0.0, 0.0, -5.0]),
        healthy=st.sampled_from([True, True, True, False]),
        max_model_len=st.sampled_from([512, 512, 128]),
        total=st.sampled_from([120, 120, 30]),
        reserved=st.integers(0, 3),
    ),
    min_size=1, max_size=8,
)


def _build(specs: list[dict]) -> tuple[ReplicaSnapshot, ...]:
    built = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        num_reserved = spec.pop("reserved")
        r = replica(f"r{i}", **spec)
        if num_reserved:
            r = r.with_reservations((SeqLoad(0, 64, 16, itl_s=0.08),) * num_reserved,
                                    5 * num_reserved, num_reserved)
        built.append(r)
    return tuple(built)


@settings(max_examples=300, deadline=None)
@given(specs=_replicas, prompt=st.sampled_from([16, 100, 250, 600]),
       max_tokens=st.sampled_from([8, 64, 200]), batch=st.booleans(),
       now_s=st.sampled_from([0.1, 0.9, 2.0]), num_best=st.integers(1, 8),
       num_sampled=st.integers(0, 4),
       ahead=st.sampled_from([NOTHING_AHEAD, QueuedAhead(2, 300, 20), QueuedAhead(9, 4000, 90)]))
def test_on_fleets_of_one_to_eight_the_candidates_decide_as_the_full_scan(
        specs, prompt, max_tokens, batch, now_s, num_best, num_sampled, ahead):
    replicas = _build(specs)
    cost = make_cost(prompt=prompt, max_tokens=max_tokens, klass=BATCH if batch else INTERACTIVE)
    if num_best + num_sampled < len(replicas):
        num_best = len(replicas)  # fleets up to the candidate bound: the whole fleet
    bounded = SloPolicy(num_candidates_best=num_best, num_candidates_sampled=num_sampled)
    full = SloPolicy()
    for step in range(3):  # decisions in a row: the pressure state evolves alike
        at_s = now_s + 0.01 * step
        assert bounded.decide(cost, snapshot(replicas, ranked=True, now_s=at_s, ahead=ahead)) \
            == full.decide(cost, snapshot(replicas, ranked=False, now_s=at_s, ahead=ahead))


def test_the_default_bound_covers_every_fleet_of_eight():
    policy = SloPolicy()
    assert policy.num_candidates_best + policy.num_candidates_sampled >= 8
    replicas = tuple(replica(f"r{i}", running=i) for i in range(8))
    fleet = RankedFleet.of(replicas, STEP)
    assert sorted(ids(pick_candidates(fleet, policy.num_candidates_best,
                                      policy.num_candidates_sampled, 5))) == sorted(ids(replicas))


def test_ranked_fleet_of_an_empty_fleet():
    fleet = RankedFleet.of((), STEP)
    assert dataclasses.astuple(fleet)[2:] == (0, 0, None, 0) and fleet.ranked == ()


@settings(max_examples=200, deadline=None)
@given(specs=_replicas, name=st.sampled_from(["always-admit", "concurrency-cap", "gradient",
                                              "token-rate"]))
def test_the_baselines_route_by_the_ranked_fleet_as_by_their_scan(specs, name):
    from policies import make_policy

    replicas = _build(specs)
    params = {"tokens_per_minute": 10**9} if name == "token-rate" else {}
    if name == "concurrency-cap":
        params = {"max_concurrency": 4}
    cost = make_cost()
    assert make_policy(name, **params).decide(cost, snapshot(replicas, ranked=True)) == \
        make_policy(name, **params).decide(cost, snapshot(replicas, ranked=False))
