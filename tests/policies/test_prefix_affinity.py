"""PrefixAffinity: llm-d's weighted scorers (prefix 3, queue 2, KV 2) and its 0.8 stickiness
filter, which holds only while the replicas holding the prefix have capacity."""

import dataclasses

import pytest
from policy_builders import decoding, make_cost, make_replica, make_snapshot, prompt_waiting

from policies import make_policy
from policies.decision import Shed
from policies.prefix_affinity import PrefixAffinity, prefix_score


def cost_cached(cached):
    return dataclasses.replace(make_cost(prompt=100), cached_prefix_tokens=cached)


def test_prefix_score_is_the_cached_share_of_the_prompt():
    cost = cost_cached({"a": 90, "b": 500})
    assert prefix_score(cost, make_replica("a")) == pytest.approx(0.9)
    assert prefix_score(cost, make_replica("b")) == 1.0
    assert prefix_score(cost, make_replica("c")) == 0.0


def test_sticks_to_the_replica_holding_the_prefix_despite_a_longer_queue():
    a = make_replica("a", waiting=[prompt_waiting()] * 4, free=40)  # loaded, holds the prefix
    b = make_replica("b")  # idle
    assert PrefixAffinity().decide(cost_cached({"a": 90}), make_snapshot(a, b)).replica_id == "a"
    # no prefix anywhere: the queue and KV scorers pick the idle one
    assert PrefixAffinity().decide(cost_cached(None), make_snapshot(a, b)).replica_id == "b"


def test_spills_once_the_sticky_replica_saturates():
    b = make_replica("b", free=100)  # idle, empty: scores 4 of 7 on load alone
    cost = cost_cached({"a": 90})
    # a holds 90 % (2.7) at half KV (1.0) and the longest queue (0): 3.7 < 4, but while it has
    # capacity (queue <= 5) the filter leaves only a
    sticky = make_replica("a", waiting=[prompt_waiting()] * 5)
    assert PrefixAffinity().decide(cost, make_snapshot(sticky, b)).replica_id == "a"
    # one more waiting request saturates it: the filter lets go and the scores pick b
    saturated = make_replica("a", waiting=[prompt_waiting()] * 6)
    assert PrefixAffinity().decide(cost, make_snapshot(saturated, b)).replica_id == "b"
    # KV utilisation over 0.8 saturates it too (a queue of 3 alone would not)
    full = make_replica("a", free=10, total=100, running=[decoding()],
                        waiting=[prompt_waiting()] * 3)
    assert PrefixAffinity().decide(cost, make_snapshot(full, b)).replica_id == "b"


def test_below_the_threshold_the_weighted_sum_decides():
    # 50 % cached on a (1.5 points) against b's shorter queue (2 points): b
    a = make_replica("a", waiting=[prompt_waiting()] * 2)
    b = make_replica("b")
    assert PrefixAffinity().decide(cost_cached({"a": 50}), make_snapshot(a, b)).replica_id == "b"
    # with the prefix weighted up, a
    policy = PrefixAffinity(prefix_weight=5.0)
    assert policy.decide(cost_cached({"a": 50}), make_snapshot(a, b)).replica_id == "a"


def test_never_sheds_but_for_no_healthy_replica_and_checks_its_parameters():
    assert PrefixAffinity().decide(cost_cached(None), make_snapshot(
        make_replica("a", healthy=False))) == Shed(503, "no_replica")
    with pytest.raises(ValueError, match="affinity_threshold"):
        make_policy("prefix_affinity", affinity_threshold=1.5)
    with pytest.raises(ValueError, match="queue_weight"):
        make_policy("prefix-affinity", queue_weight=-1)
