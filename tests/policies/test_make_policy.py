import pytest
from policy_builders import make_cost, make_replica, make_snapshot

import policies
from policies import (
    AlwaysAdmit,
    ConcurrencyCap,
    Gradient,
    Saturation,
    SloPolicy,
    TokenRate,
    make_policy,
    policy_names,
)
from policies.decision import Admit


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("slo", SloPolicy),
        ("always-admit", AlwaysAdmit),
        ("concurrency-cap", ConcurrencyCap),
        ("concurrency_cap", ConcurrencyCap),
        ("saturation", Saturation),
        ("gradient", Gradient),
        ("token-rate", TokenRate),
    ],
)
def test_builds_each_policy_by_name_and_it_decides(name, cls):
    policy = make_policy(name)
    assert type(policy) is cls and policy.name == name.replace("_", "-")
    decision = policy.decide(make_cost(), make_snapshot(make_replica("a")))
    assert isinstance(decision, Admit) and decision.replica_id == "a"


def test_default_first_and_every_name_builds():
    assert policy_names()[0] == "slo"
    assert sorted(policy_names()) == sorted(
        ["slo", "always-admit", "concurrency-cap", "saturation", "gradient", "token-rate",
         "round-robin", "prefix-affinity"]
    )


def test_params_reach_the_policy_and_each_call_builds_a_new_one():
    cap = make_policy("concurrency-cap", max_concurrency=7)
    assert cap.max_concurrency == 7
    assert make_policy("gradient") is not make_policy("gradient")
    assert make_policy("token-rate", tokens_per_minute=5, per_tenant=False).per_tenant is False


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown policy 'fifo'.*slo.*always-admit.*token-rate"):
        make_policy("fifo")


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("concurrency-cap", {"max_concurrency": 0}),
        ("concurrency-cap", {"max_inflight": 3}),  # not a parameter of this policy
        ("always-admit", {"max_concurrency": 3}),
        ("saturation", {"max_kv_usage_ratio": 2.0}),
        ("gradient", {"latency": "p50"}),
        ("token-rate", {"tokens_per_minute": -1}),
        ("slo", {"ttft_safety_ratio": 30.0}),
        ("slo", {"itl_safety_ratio": 0.9}),  # a ratio below 1 would pace past the ITL
        ("slo", {"itl_safety_ratio": 11.0}),
    ],
)
def test_bad_params_are_value_errors(name, params):
    with pytest.raises(ValueError):
        make_policy(name, **params)


def test_package_exports_are_explicit():
    assert "make_policy" in policies.__all__ and "Policy" in policies.__all__
    for name in policies.__all__:
        assert hasattr(policies, name), name
