"""The guard's incremental fleet ranking: equal to ranking the whole fleet at once, updated by
the replicas that changed, and carried on the LoadState's snapshots."""

from __future__ import annotations

import pytest

from guard.replicas.fleet_ranking import FleetRanking
from guard.replicas.load_state import LoadState
from policies.candidates import MIN_RANKED_REPLICAS, RankedFleet
from policies.snapshot import ReplicaSnapshot, SeqLoad
from tests.policies.policy_builders import STEP, make_cost
from tests.support.admission import state_doc


def replica(rid: str, *, waiting_prompt: int = 0, healthy: bool = True,
            max_model_len: int = 2048) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        replica_id=rid, observed_s=0.0, block_size=16, num_total_blocks=400,
        num_free_blocks=400, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=max_model_len,
        waiting=(SeqLoad(0, waiting_prompt, 8),) if waiting_prompt else (), healthy=healthy)


def ids(fleet: RankedFleet) -> list[str]:
    return [r.replica_id for r in fleet.ranked]


def test_below_min_replicas_there_is_no_ranking():
    ranking = FleetRanking(min_replicas=3)
    ranking.update(replica("a"), STEP)
    ranking.update(replica("b"), STEP)
    assert ranking.view() is None
    ranking.update(replica("c"), STEP)
    ranking.set_order(["a", "b", "c"])
    assert ids(ranking.view()) == ["a", "b", "c"]


def test_one_changed_replica_moves_and_the_view_equals_a_full_ranking():
    ranking = FleetRanking(min_replicas=1)
    replicas = [replica(f"r{i}", waiting_prompt=100 * i) for i in range(5)]
    for r in replicas:
        ranking.update(r, STEP)
    ranking.set_order(r.replica_id for r in replicas)
    assert ids(ranking.view()) == ["r0", "r1", "r2", "r3", "r4"]
    replicas[0] = replica("r0", waiting_prompt=1000)  # the best replica took a long prompt
    ranking.update(replicas[0], STEP)
    assert ids(ranking.view()) == ["r1", "r2", "r3", "r4", "r0"]
    assert ranking.view() == RankedFleet.of(tuple(replicas), STEP)


def test_an_unhealthy_replica_leaves_the_ranking_and_returns_with_good_state():
    ranking = FleetRanking(min_replicas=1)
    for rid in "abc":
        ranking.update(replica(rid), STEP)
    ranking.update(replica("b", healthy=False), STEP)
    assert ids(ranking.view()) == ["a", "c"]
    ranking.update(replica("b"), STEP)
    assert ids(ranking.view()) == ["a", "b", "c"]


def test_limits_are_the_largest_of_every_replica():
    ranking = FleetRanking(min_replicas=1)
    ranking.update(replica("a", max_model_len=1024), STEP)
    ranking.update(replica("b", max_model_len=4096, healthy=False), STEP)
    assert ranking.view().max_model_len == 4096
    ranking.update(replica("b", max_model_len=512, healthy=False), STEP)
    assert ranking.view().max_model_len == 1024


def test_min_replicas_is_validated():
    with pytest.raises(ValueError, match="min_replicas"):
        FleetRanking(min_replicas=0)


def _fleet(num_replicas: int) -> LoadState:
    load_state = LoadState()
    for k in range(num_replicas):
        load_state.update_from_kvguard_state(f"r{k}", state_doc(num_free_blocks=1000), 0.0)
    return load_state


def test_load_state_offers_no_ranking_for_a_small_fleet():
    assert _fleet(MIN_RANKED_REPLICAS - 1).snapshot(0.1).fleet is None


def test_load_state_ranking_follows_reservations_and_equals_the_full_ranking():
    load_state = _fleet(MIN_RANKED_REPLICAS)
    snapshot = load_state.snapshot(0.1)
    assert len(snapshot.fleet.ranked) == MIN_RANKED_REPLICAS
    best = snapshot.fleet.ranked[0].replica_id
    load_state.reserve(best, "q1", make_cost("q1", prompt=200, max_tokens=32), 0.1)
    snapshot = load_state.snapshot(0.1)
    assert snapshot.fleet.ranked[-1].replica_id == best  # the only replica with work
    assert [r.replica_id for r in snapshot.fleet.ranked] == [
        r.replica_id for r in RankedFleet.of(snapshot.replicas, load_state.step_time_model(best)
                                             ).ranked]
    load_state.release("q1")
    assert load_state.snapshot(0.1).fleet.ranked[-1].replica_id != best


def test_a_replica_that_joins_or_leaves_is_picked_up_without_a_restart():
    load_state = _fleet(MIN_RANKED_REPLICAS)
    load_state.update_from_kvguard_state("new", state_doc(num_free_blocks=1000), 0.2)
    snapshot = load_state.snapshot(0.3)
    assert "new" in {r.replica_id for r in snapshot.fleet.ranked}
    assert snapshot.replicas[-1].replica_id == "new"
    assert snapshot.fleet.position["new"] == len(snapshot.replicas) - 1
    load_state.mark_unhealthy("r3", 0.4)
    snapshot = load_state.snapshot(0.5)
    assert "r3" not in {r.replica_id for r in snapshot.fleet.ranked}
    assert "r3" in {r.replica_id for r in snapshot.replicas}  # still known, not picked


def test_least_loaded_and_in_flight_follow_the_changes():
    load_state = _fleet(MIN_RANKED_REPLICAS)
    for i in range(3):
        load_state.reserve("r0", f"q{i}", make_cost(f"q{i}"), 0.1)
    load_state.reserve("r1", "q9", make_cost("q9"), 0.1)
    snapshot = load_state.snapshot(0.1)
    full = RankedFleet.of(snapshot.replicas, load_state.step_time_model("r0"))
    assert snapshot.fleet.num_inflight == full.num_inflight == 4
    assert snapshot.fleet.least_loaded == full.least_loaded
    assert snapshot.fleet.least_loaded.replica_id == "r10"  # idle: then the lowest id
    load_state.release("q9")
    assert load_state.snapshot(0.1).fleet.num_inflight == 3


def test_keys_that_time_made_stale_are_refreshed_in_turn():
    drained = ReplicaSnapshot(
        replica_id="a", observed_s=0.0, block_size=16, num_total_blocks=400,
        num_free_blocks=400, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
        running=(SeqLoad(64, 0, 8),), waiting=(SeqLoad(0, 2000, 8),))
    busy = ReplicaSnapshot(
        replica_id="b", observed_s=0.0, block_size=16, num_total_blocks=400,
        num_free_blocks=400, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
        running=tuple(SeqLoad(64, 0, 50) for _ in range(6)))
    stale = FleetRanking(min_replicas=1, num_refreshed=0)
    fresh = FleetRanking(min_replicas=1, num_refreshed=1)
    for ranking in (stale, fresh):
        ranking.update(drained, STEP)
        ranking.update(busy, STEP)
        assert ids(ranking.view(0.0)) == ["b", "a"]  # a's 2,000 prompt tokens are pending
    for _ in range(2):  # 60 s later they are long prefilled: only a refresh sees it
        stale.view(60.0)
        fresh.view(60.0)
    assert ids(stale.view(60.0)) == ["b", "a"]
    assert ids(fresh.view(60.0)) == ["a", "b"]
    assert fresh.view(60.0).ranked == RankedFleet.of((drained, busy), STEP, 60.0).ranked


def test_at_fleet_scale_the_snapshots_step_time_is_the_healthy_replicas_mean():
    load_state = _fleet(MIN_RANKED_REPLICAS)
    load_state.mark_unhealthy("r0", 0.1)
    snapshot = load_state.snapshot(0.2)
    models = [load_state.step_time_model(r.replica_id) for r in snapshot.replicas if r.healthy]
    expected = [sum(c) / len(models) for c in zip(*(m.as_tuple() for m in models), strict=True)]
    assert snapshot.step_time.as_tuple() == pytest.approx(expected, rel=1e-12)
