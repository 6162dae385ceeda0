"""A state refresh costs what changed, and decides exactly as the eager refresh did.

At fleet scale a refresh leaves the fleet-wide work (the tuple of every replica's view, the
mean step-time model) to the next snapshot, and a replica whose snapshots carry a learned
limit or a weight keeps the sums its state document already gave. The reference here is the
refresh as it was before: every refresh rebuilt the fleet's tuple and mean model, and stamped
the guard's knowledge on a snapshot through ``dataclasses.replace``. Fed the same streamed
deltas, reservations, limits, health changes and resyncs, both give equal snapshots (field by
field, their loads, the mean model to the last bit, the ranked fleet) and the same decisions
at every query.
"""

from __future__ import annotations

import dataclasses
import json

from chaos.bench.scale import stream_events
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import StreamStateSource
from policies.candidates import MIN_RANKED_REPLICAS
from policies.slo import SloPolicy
from policies.snapshot import ReplicaSnapshot
from serving.state_delta import StateDeltas
from tests.policies.policy_builders import make_cost

NUM_REPLICAS = MIN_RANKED_REPLICAS + 8  # the fleet-scale path: ranked, running-sum mean


class _EagerLoadState(LoadState):
    """``LoadState`` with the refresh as it was: the fleet's views and mean model rebuilt on
    every refresh, the guard's stamps put on through ``dataclasses.replace``."""

    def _set_base(self, replica, base):  # noqa: ANN001, ANN202 - the base class's signature
        if base.healthy and base.replica_id in self._left:
            base = dataclasses.replace(base, healthy=False)
        weight = self._weights.get(base.replica_id, 1.0)
        if base.weight != weight or base.concurrency_limit != replica.concurrency_limit \
                or base.first_token_s != replica.first_token_s:
            base = dataclasses.replace(base, weight=weight,
                                       concurrency_limit=replica.concurrency_limit,
                                       first_token_s=replica.first_token_s)
        replica.base = base
        replica.combined = None
        self._mean_step_time.count(base.replica_id, replica.model if base.healthy else None)
        self._snapshots = None
        self._changed_ids.add(base.replica_id)
        self._step_time = None
        base.load  # noqa: B018
        self._views()
        return base


def _replica_events(num_events: int) -> list[list[bytes]]:
    """Each replica's stream: a full document, then deltas (decode steps, a sequence done,
    one started, one arrived, iteration samples: refits every few deltas)."""
    return [stream_events(k, 6 + 3 * (k % 7), num_events) for k in range(NUM_REPLICAS)]


def _assert_same(a, b) -> None:  # noqa: ANN001 - two LoadSnapshots
    assert a.replicas == b.replicas
    assert [r.load for r in a.replicas] == [r.load for r in b.replicas]
    assert a.step_time.as_tuple() == b.step_time.as_tuple()  # to the last bit
    assert a.fleet == b.fleet


def test_streamed_refreshes_give_the_eager_refreshs_snapshots_and_decisions():
    num_events = 30
    streams = _replica_events(num_events)
    weights = {"r3": 2.0, "r11": 0.5}
    new, eager = LoadState(weights=weights), _EagerLoadState(weights=weights)
    sources = [StreamStateSource(f"http://r{k}") for k in range(NUM_REPLICAS)]
    policy, reference = SloPolicy(), SloPolicy()
    admitted: list[str] = []
    num_decisions = num_queries = 0
    for e in range(num_events + 1):
        now_s = 0.1 * e
        for k, source in enumerate(sources):
            if e == 12 and k == 5:  # a lost delta: a new stream, its full document first
                doc = {**source.document(), "iterations": []}
                source = sources[5] = StreamStateSource("http://r5")
                source.feed(json.loads(json.dumps(StateDeltas().event(doc))))
            elif e > 12 and k == 5:
                continue  # (its old stream's deltas do not follow the new one)
            else:
                source.feed(json.loads(streams[k][e]))
            payload = source.take()
            for load in (new, eager):
                load.update_from_kvguard_state(f"r{k}", payload, now_s)
            if k % 9 == 4:  # the guard's view changes between refreshes as a proxy's does
                if e == 8:
                    for load in (new, eager):
                        load.set_concurrency_limit(f"r{k}", 20 + k, 0.25)
                if e == 15:
                    for load in (new, eager):
                        load.mark_unhealthy(f"r{k}", now_s)
            if k % 4 == 0 and e % 3 == 0:  # a heartbeat: only the clock moved
                for load in (new, eager):
                    load.touch(f"r{k}", now_s + 0.05)
            if k % 8 == 7:  # a query now and then, mid-fleet
                a, b = new.snapshot(now_s), eager.snapshot(now_s)
                _assert_same(a, b)
                num_queries += 1
                cost = make_cost(f"q{e}-{k}", prompt=200 + 40 * k, max_tokens=64,
                                 arrival_s=now_s)
                decision = policy.decide(cost, a)
                assert decision == reference.decide(cost, b)
                num_decisions += 1
                if hasattr(decision, "replica_id"):
                    for load in (new, eager):
                        load.reserve(decision.replica_id, cost.request_id, cost, now_s)
                    admitted.append(cost.request_id)
                    if len(admitted) > 6:
                        released = admitted.pop(0)
                        for load in (new, eager):
                            load.release(released)
        if e == 20:
            for load in (new, eager):
                load.leave("r9", now_s)
    _assert_same(new.snapshot(10.0), eager.snapshot(10.0))
    # every replica's model was refitted along the way (the replica's fit of itself, taken
    # by both alike)
    for k in range(NUM_REPLICAS):
        model = new.step_time_model(f"r{k}")
        assert model == eager.step_time_model(f"r{k}") != new.fitter(f"r{k}").prior
    assert num_decisions == num_queries >= 100 and len(admitted) == 6


def test_a_refresh_at_fleet_scale_leaves_the_fleets_tuple_and_mean_model_to_the_snapshot(
        monkeypatch):
    """One replica's refresh does not rebuild what the whole fleet shares (at 256 replicas
    refreshing at 10 Hz most of those were never read); the next snapshot does, once."""
    streams = _replica_events(2)
    load = LoadState()
    sources = [StreamStateSource(f"http://r{k}") for k in range(NUM_REPLICAS)]
    for k, source in enumerate(sources):
        source.feed(json.loads(streams[k][0]))
        load.update_from_kvguard_state(f"r{k}", source.take(), 0.0)
    load.snapshot(0.0)
    built = []
    monkeypatch.setattr(load, "_mean_model", lambda replicas: built.append(replicas))
    for k, source in enumerate(sources):
        source.feed(json.loads(streams[k][1]))
        load.update_from_kvguard_state(f"r{k}", source.take(), 0.1)
    assert built == []
    load.snapshot(0.1)
    assert len(built) == 1 and len(built[0]) == NUM_REPLICAS


def test_a_replica_with_a_learned_limit_keeps_the_sums_its_state_gave(monkeypatch):
    """Stamping the learned limit (or a weight) on a refreshed snapshot keeps the group sums
    the document already made: before, it rebuilt the snapshot and every refresh of a
    replica with a learned limit made a record of each of its sequences and summed them."""
    import guard.replicas.documents as documents

    load = LoadState(weights={"r0": 3.0})
    load.set_concurrency_limit("r0", 24, 0.3)
    source = StreamStateSource("http://r0")
    events = stream_events(0, 64, 2)
    source.feed(json.loads(events[0]))
    load.update_from_kvguard_state("r0", source.take(), 0.0)
    made = []
    real = documents.seq_fields
    monkeypatch.setattr(documents, "seq_fields", lambda *a: made.append(a) or real(*a))
    for event in events[1:]:
        source.feed(json.loads(event))
        base = load.update_from_kvguard_state("r0", source.take(), 0.1)
        assert (base.weight, base.concurrency_limit, base.first_token_s) == (3.0, 24, 0.3)
        assert base.load.num_decode_seqs == len(base.running) > 50
    assert made == []


def test_restamped_equals_dataclasses_replace_and_refuses_summed_fields():
    base = ReplicaSnapshot("r0", 1.0, 16, 100, 50, 8, 512, 4096)
    changes = {"observed_s": 2.0, "healthy": False, "weight": 2.0, "concurrency_limit": 5,
               "first_token_s": 0.4}
    assert base.restamped(**changes) == dataclasses.replace(base, **changes)
    try:
        base.restamped(num_free_blocks=3)
    except TypeError as exc:
        assert "num_free_blocks" in str(exc)
    else:
        raise AssertionError("a field the sums read was restamped")


def test_assembled_equals_the_constructor_and_checks_as_it_does():
    fields = {"replica_id": "r0", "observed_s": 1.0, "block_size": 16,
              "num_total_blocks": 100, "num_free_blocks": 50, "max_num_seqs": 8,
              "max_num_batched_tokens": 512, "max_model_len": 4096, "weight": 2.0}
    assert ReplicaSnapshot.assembled(**fields) == ReplicaSnapshot(**fields)
    for bad in ({k: v for k, v in fields.items() if k != "block_size"},
                {**fields, "num_blocks": 3}):
        try:
            ReplicaSnapshot.assembled(**bad)
        except TypeError:
            pass
        else:
            raise AssertionError(f"assembled took {sorted(bad)}")
