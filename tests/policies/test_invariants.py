"""Random snapshots: every policy answers a well-formed decision; the SLO policy keeps its promises."""

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import STEP, make_cost, make_replica

from policies import make_policy, policy_names
from policies.decision import Admit, Queue, Shed
from policies.retry_budget import RetryBudgetView
from policies.snapshot import LoadSnapshot, SeqLoad

seqs = st.lists(
    st.builds(
        SeqLoad,
        st.integers(0, 600),
        st.integers(0, 300),
        st.integers(0, 200),
        st.one_of(st.none(), st.floats(0.005, 0.2)),
    ),
    max_size=12,
)
replicas = st.builds(
    lambda i, free, total, running, waiting, inflight, healthy, age: make_replica(
        f"r{i}",
        free=min(free, total),
        total=total,
        running=running,
        waiting=waiting,
        inflight=inflight,
        healthy=healthy,
        observed_s=10.0 - age,
    ),
    st.integers(0, 3),
    st.integers(0, 200),
    st.integers(1, 200),
    seqs,
    seqs,
    st.integers(0, 10),
    st.booleans(),
    st.floats(0.0, 4.0),
)
costs = st.builds(
    lambda prompt, max_tokens, arrival, retry: make_cost(
        prompt=prompt, max_tokens=max_tokens, arrival_s=arrival, is_retry=retry
    ),
    st.integers(1, 900),
    st.integers(1, 400),
    st.floats(8.5, 10.0),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(costs, st.lists(replicas, max_size=4, unique_by=lambda r: r.replica_id), st.booleans())
def test_decisions_are_well_formed_and_slo_admits_only_what_fits(cost, reps, retry_over):
    snapshot = LoadSnapshot(
        now_s=10.0, replicas=tuple(reps), step_time=STEP,
        retry_budget=RetryBudgetView(frozenset({"acme"} if retry_over else ()))
    )
    healthy_ids = {r.replica_id for r in reps if r.healthy}
    fresh = {r.replica_id: r for r in snapshot.fresh_replicas()}
    for name in policy_names():
        d = make_policy(name).decide(cost, snapshot)
        assert isinstance(d, Admit | Queue | Shed)
        if isinstance(d, Admit):
            assert d.replica_id in healthy_ids
        if isinstance(d, Shed):
            assert d.status in (400, 429, 503) and d.reason
    d = make_policy("slo").decide(cost, snapshot)
    if isinstance(d, Admit) and d.predicted_ttft_s is not None:
        replica = fresh[d.replica_id]
        assert cost.arrival_s + d.predicted_ttft_s <= cost.deadline_s + 1e-9
        assert cost.num_blocks <= replica.num_available_blocks
    if isinstance(d, Queue):
        assert snapshot.now_s < d.until_s <= cost.deadline_s
