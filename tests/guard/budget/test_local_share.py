"""The local share and what a guard owes Redis after it: exact figures, injected clock."""

from __future__ import annotations

from guard.budget.local_share import LocalShare
from guard.budget.store import BudgetLimits, Denied, Grant
from tests.support.admission import FakeClock

LIMITS = BudgetLimits(tokens_per_minute=600, requests_per_minute=60)


def share(num_guards: int = 3) -> tuple[LocalShare, FakeClock]:
    clock = FakeClock(100.0)
    local = LocalShare(lambda tenant: LIMITS, clock)
    local.live_guards = num_guards
    return local, clock


def grants(local: LocalShare, num: int, seen=None, owed=(0.0, 0.0), epoch="e1") -> list:
    return [local.reserve("acme", 10, 30.0, epoch, seen, owed) for _ in range(num)]


def test_starts_from_its_share_of_what_redis_had_left_not_a_full_share():
    local, _ = share()
    outcomes = grants(local, 10, seen=(120.0, 12.0))  # Redis had 12 requests left: 4 each
    assert [isinstance(o, Grant) for o in outcomes] == [True] * 4 + [False] * 6
    assert {o.reason for o in outcomes if isinstance(o, Denied)} == {"rpm_limit"}


def test_a_flapping_breaker_does_not_hand_out_the_share_again_from_a_stale_report():
    """Redis said 30 requests left (10 a guard). This guard's episode spends its 10 and ends;
    its breaker opens again at once, and the next episode starts from the same report (other
    guards' local grants are not charged yet): it may not spend those 10 again."""
    local, clock = share()
    first = grants(local, 12, seen=(300.0, 30.0))
    assert sum(isinstance(o, Grant) for o in first) == 10
    local.end("e1")
    again = grants(local, 12, seen=(300.0, 30.0))
    assert sum(isinstance(o, Grant) for o in again) == 0
    local.end("e1")
    clock.advance(6.0)  # the local bucket refills at the share's rate: 20 a minute → 2
    assert sum(isinstance(o, Grant) for o in grants(local, 12, seen=(300.0, 30.0))) == 2


def test_a_tenant_never_seen_on_redis_starts_from_a_full_share_less_what_is_owed():
    local, _ = share()
    outcomes = grants(local, 30, owed=(0.0, 5.0))  # 60 ÷ 3 = 20, 5 still owed to Redis
    assert sum(isinstance(o, Grant) for o in outcomes) == 15


def test_kept_redis_is_charged_the_net_local_use_and_later_refunds_go_back_to_it():
    local, _ = share()
    made = [o for o in grants(local, 3, seen=(600.0, 60.0)) if isinstance(o, Grant)]
    local.finish(made[0], 4)  # used 4 of 10: 6 refunded locally
    local.finish(made[1], None)  # released: 10 tokens and the request back
    assert local.end("e1") == {"acme": (30.0 - 6 - 10, 2.0)}
    assert not local.in_episode
    assert local.finish(made[2], 7) == (3.0, 0.0)  # Redis gets this refund


def test_a_redis_that_lost_its_state_is_charged_the_guards_debt():
    local, clock = share()
    grants(local, 2, seen=(300.0, 30.0), epoch="e1")  # share: 100 tokens, 10 requests
    clock.advance(6.0)  # refill of the share: 600 / 3 per minute → 20 tokens, 2 requests
    # capacity of the share (200, 20) less the level now (100 - 20 + 20, 10 - 2 + 2)
    assert local.end("e2") == {"acme": (100.0, 10.0)}


def test_a_start_up_share_never_seeded_from_redis_is_charged_the_net_local_use():
    local, clock = share()  # a guard that never reached Redis: full share, no epoch
    made = [o for o in grants(local, 25, epoch=None) if isinstance(o, Grant)]
    assert len(made) == 20  # 60 ÷ 3
    local.finish(made[0], None)  # released: 10 tokens and the request back
    clock.advance(6.0)  # refill is no credit: the share was never Redis's to begin with
    local.live_guards = 1  # the first heartbeat saw fewer guards than expected: no matter
    assert local.end("e7") == {"acme": (190.0, 19.0)}
