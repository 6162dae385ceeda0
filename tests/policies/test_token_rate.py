import pytest
from policy_builders import make_cost, make_replica, make_sample, make_snapshot

from policies.decision import Admit, Shed
from policies.token_rate import TokenRate


def snap(now_s):
    return make_snapshot(make_replica("a"), now_s=now_s)


def admit(policy, cost, now_s):
    decision = policy.decide(cost, snap(now_s))
    if isinstance(decision, Admit):
        policy.admitted(cost, decision.replica_id, now_s)
    return decision


def test_charges_prompt_plus_max_tokens_per_tenant_window():
    policy = TokenRate(100)
    assert admit(policy, make_cost("r1"), 10.0) == Admit("a")  # 32 + 32 = 64 tokens
    assert policy.num_used_tokens("acme", 10.0) == 64
    assert admit(policy, make_cost("r2"), 15.0) == Shed(429, "tpm_limit", retry_after_s=45.0)
    assert admit(policy, make_cost("r3", prompt=20, max_tokens=16), 15.0) == Admit(
        "a"
    )  # 64 + 36 = 100
    assert policy.num_used_tokens("acme", 15.0) == 100


def test_rejected_requests_are_never_charged():
    policy = TokenRate(100)
    admit(policy, make_cost("r1"), 0.0)
    for i in range(5):
        assert isinstance(admit(policy, make_cost(f"x{i}"), 1.0), Shed)
    assert policy.num_used_tokens("acme", 1.0) == 64
    policy.decide(make_cost("r2", tenant="other"), snap(1.0))  # decided but never admitted
    assert policy.num_used_tokens("other", 1.0) == 0


def test_window_rolls_over_on_the_minute():
    policy = TokenRate(100)
    admit(policy, make_cost("r1"), 59.0)
    assert admit(policy, make_cost("r2"), 59.999) == Shed(
        429, "tpm_limit", retry_after_s=pytest.approx(0.001)
    )
    assert admit(policy, make_cost("r3"), 60.0) == Admit("a")
    assert policy.num_used_tokens("acme", 60.0) == 64


def test_tenants_have_separate_budgets_unless_shared():
    per_tenant = TokenRate(100)
    admit(per_tenant, make_cost("r1", tenant="acme"), 0.0)
    assert admit(per_tenant, make_cost("r2", tenant="globex"), 0.0) == Admit("a")
    shared = TokenRate(100, per_tenant=False)
    admit(shared, make_cost("r1", tenant="acme"), 0.0)
    assert admit(shared, make_cost("r2", tenant="globex"), 0.0) == Shed(
        429, "tpm_limit", retry_after_s=60.0
    )


def test_completion_settles_to_the_actual_tokens_in_the_same_window():
    policy = TokenRate(100)
    admit(policy, make_cost("r1"), 1.0)
    policy.observe(make_sample("r1", now_s=2.0, prompt=32, output=8))  # used 40 of 64
    assert policy.num_used_tokens("acme", 2.0) == 40
    assert admit(policy, make_cost("r2", prompt=28, max_tokens=32), 3.0) == Admit("a")  # 40 + 60


def test_completion_in_a_later_window_refunds_nothing_into_the_new_one():
    policy = TokenRate(100)
    admit(policy, make_cost("r1"), 59.0)
    admit(policy, make_cost("r2"), 61.0)
    policy.observe(make_sample("r1", now_s=61.5, output=0))
    assert policy.num_used_tokens("acme", 61.5) == 64


def test_a_request_larger_than_a_whole_window_never_fits():
    assert TokenRate(50).decide(make_cost(), snap(0.0)) == Shed(
        429, "tpm_limit", should_retry=False
    )


def test_no_healthy_replica_is_503():
    snapshot = make_snapshot(make_replica("a", healthy=False))
    assert TokenRate(100).decide(make_cost(), snapshot) == Shed(503, "no_replica")


@pytest.mark.parametrize("bad", [0, -5, 10.5, True])
def test_rejects_bad_limits(bad):
    with pytest.raises(ValueError, match="tokens_per_minute"):
        TokenRate(bad)
