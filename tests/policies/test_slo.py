"""SloPolicy table tests. STEP: 10 ms + 0.1 ms per prefill token + 1 ms per decoding seq.

Interactive class: TTFT 1.0 s, ITL 80 ms; a default cost arrives at 0 with deadline 1.0 and
needs 4 blocks (32 prompt + 32 max tokens)."""

import dataclasses

import pytest
from policy_builders import (
    BATCH,
    INTERACTIVE,
    decoding,
    make_cost,
    make_replica,
    make_sample,
    make_snapshot,
    prompt_waiting,
)

from policies.client_patience import MAX_CLIENT_KEYS, client_software, patience_quantile_s
from policies.cost import RequestClass
from policies.decision import Admit, Queue, Shed
from policies.slo import SloPolicy, shed_order
from policies.snapshot import QueuedAhead, SeqLoad

# Three running seqs commit the replica's 5 free blocks; the next 4 free after 16 steps of 13 ms.
KV_SHORT = dict(free=5, running=[decoding(32, 16), decoding(32, 16), decoding(16, 40)])
KV_WAIT_S = 16 * 0.013
WAIT_BEHIND_30_S = (16 + 12 * 17) * 0.013  # KV_SHORT behind 30 queued 4-block requests
KV_OWN_PREFILL_S = 0.013 + 0.0032


def decide(*replicas, cost=None, now_s=0.0, policy=None, **snapshot_args):
    # The tables below check the forecast arithmetic exactly, so no headroom on top of it.
    policy = policy or SloPolicy(ttft_safety_ratio=1.0)
    return policy.decide(
        cost or make_cost(), make_snapshot(*replicas, now_s=now_s, **snapshot_args)
    )


def test_idle_replica_admits_with_the_predicted_ttft_since_arrival():
    d = decide(make_replica("a"), cost=make_cost(arrival_s=0.2), now_s=0.25)
    assert d == Admit("a", pytest.approx(0.05 + 0.0132))


def test_chooses_the_replica_with_the_lowest_predicted_ttft_not_the_fewest_requests():
    backlog = make_replica("a", waiting=[prompt_waiting(500)])  # 1 request, 532 tokens to prefill
    busy = make_replica("b", running=[decoding()] * 4)  # 4 requests, all decoding
    assert decide(backlog, busy) == Admit("b", pytest.approx(0.014 + 0.0032))
    assert decide(busy, backlog) == Admit("b", pytest.approx(0.014 + 0.0032))


def test_an_exact_tie_goes_to_the_least_loaded_not_the_first_listed():
    """Idle replicas forecast alike: the tie is broken in least-loaded order (requests ÷
    weight, then heavier, then id), whatever order the snapshot lists them in."""
    assert decide(make_replica("b"), make_replica("a")) == decide(make_replica("a"),
                                                                  make_replica("b"))
    assert decide(make_replica("b"), make_replica("a")).replica_id == "a"
    heavy = make_replica("b", weight=2.0)
    assert decide(make_replica("a"), heavy).replica_id == "b"
    # decoding reservations add no prefill: the forecasts still tie, the request counts do not
    two = make_replica("a", reserved=[decoding()] * 2, reserved_blocks=8)
    one = make_replica("b", reserved=[decoding()], reserved_blocks=4)
    assert decide(two, one).replica_id == "b"
    assert decide(dataclasses.replace(two, weight=3.0), one).replica_id == "a"  # 2/3 < 1


def test_weight_does_not_bend_a_fresh_forecast():
    backlog = make_replica("a", waiting=[prompt_waiting(500)], weight=100.0)
    busy = make_replica("b", running=[decoding()] * 4)
    assert decide(backlog, busy).replica_id == "b"


def test_stale_state_routes_by_requests_per_weight():
    a = make_replica("a", running=[decoding()] * 5, observed_s=0.0, weight=3.0)  # 5 / 3
    b = make_replica("b", running=[decoding()] * 2, observed_s=0.0)  # 2 / 1
    cost = make_cost(arrival_s=4.9, deadline_s=10.0)
    assert decide(a, b, cost=cost, now_s=5.0) == Admit("a")
    assert decide(dataclasses.replace(a, weight=2.0), b, cost=cost, now_s=5.0) == Admit("b")


def test_refuses_a_replica_whose_join_would_push_a_running_stream_past_its_itl():
    strict = make_replica("a", running=[decoding(itl_s=0.0115)])  # join step 12 ms > 11.5 ms
    slower = make_replica("b", waiting=[prompt_waiting(500)])
    assert decide(strict, slower) == Admit("b", pytest.approx(9 * 0.010 + 0.0532))
    # Alone, it waits for the batch to shrink, until the deadline minus its own prefill.
    assert decide(strict) == Queue(pytest.approx(1.0 - 0.0142), "itl_wait", pytest.approx(0.0142))


def test_a_stream_exactly_at_its_itl_limit_is_not_pushed_past_it():
    at_limit = make_replica("a", running=[decoding(itl_s=0.012)])
    assert decide(at_limit) == Admit("a", pytest.approx(0.0142))


def test_joined_step_over_the_class_itl_queues_if_the_request_alone_would_meet_it():
    tight = RequestClass("tight", ttft_s=1.0, itl_s=0.012)
    replica = make_replica("a", running=[decoding()] * 3)  # join step 14 ms
    assert isinstance(decide(replica, cost=make_cost(klass=tight)), Queue)
    impossible = RequestClass("impossible", ttft_s=1.0, itl_s=0.005)  # alone: 11 ms
    never = Shed(503, "slo_unattainable", should_retry=False)  # not even alone: never retry
    assert decide(replica, cost=make_cost(klass=impossible)) == never


def test_no_free_blocks_queues_while_blocks_will_free_before_the_deadline():
    d = decide(make_replica("a", **KV_SHORT))
    assert d == Queue(
        pytest.approx(1.0 - KV_OWN_PREFILL_S),
        "kv_wait",
        pytest.approx(KV_WAIT_S + KV_OWN_PREFILL_S),
    )


def test_no_free_blocks_sheds_with_the_predicted_free_time_when_too_late():
    d = decide(make_replica("a", **KV_SHORT), now_s=0.9)
    assert d == Shed(503, "no_kv_capacity", retry_after_s=pytest.approx(KV_WAIT_S))


def test_prefers_a_replica_that_can_start_now_over_a_faster_one_that_must_wait():
    short = make_replica("a", **KV_SHORT)  # would give 0.224 s, after the blocks free
    backlog = make_replica("b", total=300, free=200, waiting=[prompt_waiting(2000)])  # 32 steps
    assert decide(short, backlog) == Admit("b", pytest.approx(32 * 0.010 + 0.2032))


def test_backlog_past_the_deadline_is_unattainable():
    flooded = make_replica("a", total=2000, free=1500, waiting=[prompt_waiting(20000)])
    assert decide(flooded) == Shed(503, "slo_unattainable")


def test_deadline_already_past_is_unattainable():
    assert decide(make_replica("a"), now_s=1.0) == Shed(503, "slo_unattainable")


def test_no_healthy_replica():
    assert decide(make_replica("a", healthy=False)) == Shed(503, "no_replica")
    assert decide() == Shed(503, "no_replica")


@pytest.mark.parametrize(
    ("cost", "expected"),
    [
        (make_cost(num_blocks=101), Shed(400, "no_kv_capacity", should_retry=False)),
        (
            make_cost(prompt=1000, max_tokens=100),
            Shed(400, "context_length_exceeded", should_retry=False),
        ),
    ],
)
def test_request_larger_than_any_replica_is_never_retried(cost, expected):
    replicas = (make_replica("a", total=100), make_replica("b", total=100, healthy=False))
    assert decide(*replicas, cost=cost) == expected


def test_fresh_replicas_too_small_but_another_could_fit_is_retryable():
    small = make_replica("a", total=2, free=2, observed_s=9.0)
    stale_big = make_replica("b", total=100, observed_s=0.0)
    cost = make_cost(arrival_s=9.0)
    assert decide(small, stale_big, cost=cost, now_s=9.0) == Shed(503, "no_kv_capacity")


@pytest.mark.parametrize(
    ("inflight", "deadline_s", "expected"),
    [
        (3, 10.0, Admit("b")),  # under 4 per healthy replica: least loaded, no prediction
        (4, 10.0, Queue(5.5, "stale_state")),  # queue briefly for a refresh
        (4, 5.2, Queue(5.2, "stale_state")),  # never past the deadline
    ],
)
def test_stale_state_falls_back_to_a_small_inflight_bound(inflight, deadline_s, expected):
    # Two healthy replicas x 2 per replica = 4; the unhealthy one adds nothing to the bound.
    a = make_replica("a", inflight=inflight, running=[decoding()], observed_s=0.0)
    b = make_replica("b", observed_s=0.0)
    down = make_replica("c", observed_s=0.0, healthy=False)
    cost = make_cost(arrival_s=4.9, deadline_s=deadline_s)
    policy = SloPolicy(stale_max_inflight_per_replica=2, ttft_safety_ratio=1.0)
    assert decide(a, b, down, cost=cost, now_s=5.0, policy=policy) == expected


@pytest.mark.parametrize(
    ("inflight", "now_s", "expected"),
    [
        (3, 5.0, Admit("a")),  # fresh by its clock, but capacity unknown: the stale bound
        (4, 5.0, Queue(5.5, "stale_state")),
        (4, 5.85, Queue(5.9, "stale_state")),  # never past the deadline
    ],
)
def test_unknown_capacity_replica_falls_under_the_stale_rule(inflight, now_s, expected):
    unknown = dataclasses.replace(
        make_replica("a", free=1 << 30, total=1 << 30, inflight=inflight, observed_s=now_s),
        capacity_known=False,
    )
    cost = make_cost(arrival_s=4.9, deadline_s=5.9)
    assert decide(unknown, cost=cost, now_s=now_s) == expected


@pytest.mark.parametrize(
    ("inflight_a", "inflight_b", "expected"),
    [
        (0, 0, Admit("a")),  # both under their limits: the least loaded
        (1, 0, Admit("b")),  # "a" at its learned 1: "b" (limit 3) takes it
        (1, 2, Admit("b")),
        (1, 3, Queue(5.5, "stale_state")),  # both at their learned limits
    ],
)
def test_learned_limits_replace_the_fixed_cap_for_unknown_capacity(inflight_a, inflight_b,
                                                                   expected):
    def unknown(replica_id, inflight, limit):
        r = make_replica(replica_id, free=1 << 30, total=1 << 30, inflight=inflight,
                         observed_s=5.0)
        return dataclasses.replace(r, capacity_known=False, concurrency_limit=limit)

    cost = make_cost(arrival_s=4.9, deadline_s=6.0)
    policy = SloPolicy(stale_max_inflight_per_replica=4, ttft_safety_ratio=1.0)
    d = decide(unknown("a", inflight_a, 1), unknown("b", inflight_b, 3), cost=cost, now_s=5.0,
               policy=policy)
    assert d == expected


@pytest.mark.parametrize(
    ("now_s", "inflight", "expected"),
    [
        (5.0, 0, Admit("a")),  # 5.0 + 0.5 x 1.2 <= 6.0
        (5.0, 2, Queue(5.4, "stale_state")),  # at its limit: no later than 6.0 - 0.6
        (5.45, 0, Shed(503, "stale_state")),  # 5.45 + 0.6 > 6.0: it would miss anyway
    ],
)
def test_learned_first_token_time_must_still_land_by_the_deadline(now_s, inflight, expected):
    r = dataclasses.replace(
        make_replica("a", free=1 << 30, total=1 << 30, inflight=inflight, observed_s=now_s),
        capacity_known=False, concurrency_limit=2, first_token_s=0.5)
    cost = make_cost(arrival_s=4.9, deadline_s=6.0)
    d = decide(r, cost=cost, now_s=now_s, policy=SloPolicy(ttft_safety_ratio=1.2))
    assert d == expected


def test_a_learned_limit_never_exceeds_the_slots_the_replica_reports():
    r = dataclasses.replace(
        make_replica("a", free=1 << 30, total=1 << 30, inflight=2, observed_s=5.0),
        capacity_known=False, concurrency_limit=6, max_num_seqs=2)
    cost = make_cost(arrival_s=4.9, deadline_s=6.0)
    assert decide(r, cost=cost, now_s=5.0) == Queue(5.5, "stale_state")


def test_a_first_token_time_no_request_could_meet_does_not_block_the_replica():
    r = dataclasses.replace(
        make_replica("a", free=1 << 30, total=1 << 30, observed_s=5.0),
        capacity_known=False, concurrency_limit=2, first_token_s=0.9)
    cost = make_cost(arrival_s=4.9, deadline_s=5.9)  # 1 s budget < 0.9 x 1.2
    assert decide(r, cost=cost, now_s=5.0, policy=SloPolicy(ttft_safety_ratio=1.2)) == Admit("a")


def test_use_learned_limits_false_keeps_the_fixed_cap():
    r = dataclasses.replace(
        make_replica("a", free=1 << 30, total=1 << 30, inflight=1, observed_s=5.0),
        capacity_known=False, concurrency_limit=1)
    cost = make_cost(arrival_s=4.9, deadline_s=6.0)
    assert decide(r, cost=cost, now_s=5.0) == Queue(5.5, "stale_state")
    policy = SloPolicy(ttft_safety_ratio=1.0, use_learned_limits=False)
    assert decide(r, cost=cost, now_s=5.0, policy=policy) == Admit("a")  # 1 < the fixed 4


def test_a_learned_limit_does_not_bind_a_replica_of_known_capacity_gone_stale():
    stale = dataclasses.replace(make_replica("a", inflight=3, observed_s=0.0),
                                concurrency_limit=1)
    cost = make_cost(arrival_s=4.9, deadline_s=6.0)
    d = decide(stale, cost=cost, now_s=5.0, policy=SloPolicy(ttft_safety_ratio=1.0))
    assert d == Admit("a")  # the fixed cap (4) holds for it


def test_stale_state_without_queue_time_sheds():
    replica = make_replica("a", inflight=4, observed_s=0.0)
    cost = make_cost(arrival_s=4.9, deadline_s=10.0)
    d = decide(replica, cost=cost, now_s=5.0, policy=SloPolicy(stale_queue_s=0.0, ttft_safety_ratio=1.0))
    assert d == Shed(503, "stale_state")


@pytest.mark.parametrize(
    ("retry_over", "is_retry", "expected"),
    [
        ({"acme"}, True, Shed(503, "retry_shed", should_retry=False)),  # shed first, no wait
        ({"*"}, True, Shed(503, "retry_shed", should_retry=False)),  # the guard-wide budget
        ({"other"}, True, Queue),  # another tenant's budget is spent, not this one's
        (set(), True, Queue),  # under budget: a retry waits like anyone
        ({"acme"}, False, Queue),  # a first attempt from the same tenant
    ],
)
def test_retries_over_the_retry_budget_are_shed_first_and_told_not_to_retry(
    retry_over, is_retry, expected
):
    cost = make_cost(is_retry=is_retry)
    d = decide(make_replica("a", **KV_SHORT), cost=cost, retry_over=retry_over)
    if expected is Queue:
        assert isinstance(d, Queue) and d.reason == "kv_wait"
    else:
        assert d == expected


def test_retries_are_admitted_when_the_system_is_not_loaded():
    d = decide(make_replica("a"), cost=make_cost(is_retry=True), retry_over={"acme", "*"})
    assert isinstance(d, Admit)


def test_stale_and_full_retry_over_the_budget_is_shed():
    replica = make_replica("a", inflight=4, observed_s=0.0)
    cost = make_cost(arrival_s=4.9, deadline_s=10.0, is_retry=True)
    assert decide(replica, cost=cost, now_s=5.0, retry_over={"acme"}) == Shed(
        503, "retry_shed", should_retry=False
    )


def test_shed_order_is_lowest_class_first_then_latest_deadline():
    costs = [
        make_cost("i-late", klass=INTERACTIVE, deadline_s=5.0),
        make_cost("b-early", klass=BATCH, deadline_s=2.0),
        make_cost("i-early", klass=INTERACTIVE, deadline_s=1.0),
        make_cost("b-late", klass=BATCH, deadline_s=9.0),
    ]
    assert [c.request_id for c in shed_order(costs)] == ["b-late", "b-early", "i-late", "i-early"]
    assert shed_order([]) == []


def test_shed_order_puts_retries_before_first_attempts_of_the_same_class():
    costs = [
        make_cost("first-late", deadline_s=5.0),
        make_cost("retry-early", deadline_s=1.0, is_retry=True),
        make_cost("batch", klass=BATCH, deadline_s=2.0),
    ]
    assert [c.request_id for c in shed_order(costs)] == ["batch", "retry-early", "first-late"]


@pytest.mark.parametrize(
    "params",
    [
        {"stale_max_inflight_per_replica": -1},
        {"stale_max_inflight_per_replica": 1.5},
        {"use_learned_limits": "yes"},
        {"stale_queue_s": -1.0},
        {"pressure_hold_s": -1.0},
    ],
)
def test_rejects_bad_parameters(params):
    with pytest.raises(ValueError):
        SloPolicy(**params)


def test_the_retry_ratio_parameter_is_gone():
    """The guard's retry budget replaced it; make_policy turns it into a ValueError."""
    with pytest.raises(TypeError):
        SloPolicy(retry_shed_ratio=0.1)


def test_ttft_headroom_under_pressure_refuses_a_forecast_that_fits_only_without_it():
    """At capacity a request admitted on the very edge of its deadline misses on any forecast
    error and displaces one with slack: after an overload shed the default policy wants the
    forecast × ``ttft_safety_ratio`` to fit."""
    idle = make_replica("a")
    forecast_s = decide(idle).predicted_ttft_s  # from arrival at 0.0, decided at 0.0
    edge = make_cost(arrival_s=0.0, deadline_s=forecast_s * 1.1)
    roomy = make_cost(arrival_s=0.0, deadline_s=forecast_s * 1.3)
    tight = SloPolicy(ttft_safety_ratio=1.2)
    assert isinstance(decide(idle, cost=edge, policy=tight), Admit)  # no pressure yet
    flooded = make_replica("b", total=2000, free=1500, waiting=[prompt_waiting(20000)])
    assert decide(flooded, policy=tight) == Shed(503, "slo_unattainable")  # pressure
    assert tight.headroom_ratio(0.0) == 1.2
    assert not isinstance(decide(idle, cost=edge, policy=tight), Admit)
    assert isinstance(decide(idle, cost=roomy, policy=tight), Admit)


def test_pressure_ends_pressure_hold_s_after_the_last_overload_shed():
    policy = SloPolicy(ttft_safety_ratio=1.2, pressure_hold_s=5.0)
    flooded = make_replica("a", total=2000, free=1500, waiting=[prompt_waiting(20000)])
    assert isinstance(decide(flooded, policy=policy, now_s=0.0), Shed)
    assert [policy.headroom_ratio(t) for t in (0.0, 4.9, 5.1)] == [1.2, 1.2, 1.0]
    idle = make_replica("a", observed_s=10.0)
    forecast_s = decide(idle, now_s=10.0, cost=make_cost(arrival_s=10.0)).predicted_ttft_s
    edge = make_cost(arrival_s=10.0, deadline_s=10.0 + forecast_s * 1.1)
    assert isinstance(decide(idle, cost=edge, now_s=10.0, policy=policy), Admit)


# --- the fast no: forecast the earliest start, behind the guard's own queue -----------------
@pytest.mark.parametrize(
    ("ahead", "expected"),
    [
        (QueuedAhead(), Queue),  # first in line: the blocks free in 16 steps, it will make it
        (QueuedAhead(2, 64, 8), Queue),  # two small ones ahead: 48 steps, still in time
        (QueuedAhead(30, 960, 120), Shed),  # 30 ahead: its earliest start is seconds away
    ],
)
def test_a_request_whose_earliest_start_misses_its_deadline_is_shed_without_queueing(
    ahead, expected
):
    d = decide(make_replica("a", **KV_SHORT), queued_ahead=ahead)
    if expected is Queue:
        assert isinstance(d, Queue) and d.reason == "kv_wait"
    else:  # at once, with the predicted wait for the blocks as Retry-After: 124 blocks short,
        # 10 come back per turnover of the known seqs (3 + 3 after 16 steps, 4 after 40): 12
        # turnovers, each seat held for a whole run (1 prefill step + 16 expected tokens), then
        # the last 4 blocks 16 steps into the next one
        assert d == Shed(503, "no_kv_capacity", retry_after_s=pytest.approx(WAIT_BEHIND_30_S))


def test_the_fast_no_walks_each_replicas_reservations_once_per_decision(monkeypatch):
    """The pending prefill is O(requests in flight) to compute; the forecast behind the queue
    reuses the one of the forecast behind nothing (same replica, same instant)."""
    import policies.predictor as predictor

    calls = []
    real = predictor.pending_prefill_tokens

    def counted(replica, step_time, now_s):
        calls.append(replica.replica_id)
        return real(replica, step_time, now_s)

    monkeypatch.setattr(predictor, "pending_prefill_tokens", counted)
    # a reservation admitted since the state: its prompt is pending, so there is a walk
    resv = (SeqLoad(0, 40, 4, admitted_s=0.0),)
    replicas = [make_replica(name, **KV_SHORT, reserved=resv, reserved_blocks=3)
                for name in ("a", "b")]
    d = decide(*replicas, queued_ahead=QueuedAhead(30, 960, 120))
    assert isinstance(d, Shed) and d.reason == "no_kv_capacity"
    assert sorted(calls) == ["a", "b"]
    # nothing pending and nothing admitted since the state: no walk at all (the idle case),
    # and the same decision as with one
    calls.clear()
    replicas = [make_replica(name, **KV_SHORT) for name in ("a", "b")]
    d = decide(*replicas, queued_ahead=QueuedAhead(30, 960, 120))
    assert d == Shed(503, "no_kv_capacity", retry_after_s=pytest.approx(WAIT_BEHIND_30_S))
    assert calls == []


def test_prefill_queued_ahead_in_the_guard_counts_toward_the_first_token():
    """Not admissible now (the join step is over a running stream's ITL); the forecast behind
    20,000 queued prompt tokens is 3.4 s: shed now rather than at the deadline."""
    strict = make_replica("a", running=[decoding(itl_s=0.0115)])
    assert isinstance(decide(strict), Queue)
    d = decide(strict, queued_ahead=QueuedAhead(10, 20000, 10))
    assert d == Shed(503, "slo_unattainable")


# --- client patience --------------------------------------------------------------------------
# A long answer: 450 expected output tokens, 449 decode steps after the first token.
LONG = dict(max_tokens=900, num_blocks=4)
BACKLOG = dict(free=400, total=500, waiting=[prompt_waiting(1500)])  # TTFT 0.3932 s, join 12 ms


def completed(now_s=0.0, elapsed_s=None):
    return dataclasses.replace(make_sample(now_s=now_s), elapsed_s=elapsed_s)


def canceled(elapsed_s, now_s=0.0, client_left=True, *, ttft_s=None, output=0):
    """A client's cancellation; by default before its first token (it tells no decode pace)."""
    return dataclasses.replace(make_sample(now_s=now_s, ok=False, ttft_s=ttft_s, output=output),
                               outcome="canceled", elapsed_s=elapsed_s, client_left=client_left)


def learned(samples):
    policy = SloPolicy(ttft_safety_ratio=1.0)
    for sample in samples:
        policy.observe(sample)
    return policy


# 180 completions and 20 client cancellations after 5.5-5.8 s: 10 % of outcomes, p25 = 5.5 s
CANCELING = [completed()] * 180 + [canceled(5.5 + 0.1 * (i // 5)) for i in range(20)]

TABLE = [
    dict(replicas=[make_replica("a")], cost=make_cost()),
    dict(replicas=[make_replica("a", **BACKLOG)], cost=make_cost(**LONG)),
    dict(replicas=[make_replica("a", **KV_SHORT)], cost=make_cost()),
    dict(replicas=[make_replica("a", waiting=[prompt_waiting(5000)])], cost=make_cost()),
    dict(replicas=[make_replica("a", **BACKLOG), make_replica("b")], cost=make_cost(**LONG)),
]


@pytest.mark.parametrize("case", range(len(TABLE)))
@pytest.mark.parametrize("history", [
    [],
    [completed()] * 200,
    [completed()] * 195 + [canceled(5.5)] * 5,  # 2.5 %: under the 5 % share
    [completed()] * 9 + [canceled(5.5)] * 10,  # under 20 outcomes in the window
    [completed()] * 180 + [canceled(5.5, client_left=False)] * 20,  # the guard's own cancels
])
def test_without_client_cancellations_decisions_are_unchanged(case, history):
    row = TABLE[case]
    assert learned(history).patience.patience_s("interactive", 0.0, "acme") is None
    assert (decide(*row["replicas"], cost=row["cost"], policy=learned(history))
            == decide(*row["replicas"], cost=row["cost"]))


def test_patience_is_a_low_quantile_of_elapsed_at_cancel():
    policy = learned(CANCELING)
    assert policy.patience.patience_s("interactive", 0.0, "acme") == pytest.approx(5.5)
    assert policy.client_patience(0.0) == {"interactive": pytest.approx(5.5)}
    assert policy.patience.patience_s("batch", 0.0, "acme") is None
    assert learned([completed()] * 180 + [canceled(float(i)) for i in range(1, 21)]) \
        .patience.patience_s("interactive", 0.0, "acme") == 5.0  # nearest rank: the 5th of 20


def test_a_request_that_meets_its_ttft_but_would_be_abandoned_mid_stream_is_shed():
    """TTFT 0.39 s fits the 1 s SLO, but 0.39 + 449 × 12 ms = 5.78 s > the 5.5 s patience."""
    backlog = make_replica("a", **BACKLOG)
    cost = make_cost(**LONG)
    assert isinstance(decide(backlog, cost=cost), Admit)
    assert decide(backlog, cost=cost, policy=learned(CANCELING)) == Shed(503, "slo_unattainable")
    # an idle replica ends it in 0.0132 + 449 × 11 ms = 4.95 s: admitted; a short answer too
    assert decide(make_replica("a"), cost=cost, policy=learned(CANCELING)) == Admit(
        "a", pytest.approx(0.0132))
    assert isinstance(decide(backlog, cost=make_cost(), policy=learned(CANCELING)), Admit)
    # two replicas: the one where it ends within the patience, not the lowest TTFT alone
    assert decide(backlog, make_replica("b"), cost=cost,
                  policy=learned(CANCELING)).replica_id == "b"


def test_patience_tightens_how_long_a_blocked_request_may_queue():
    """KV_SHORT: blocks free in 0.208 s, the join step is 14 ms; with 7 s patience the first
    token must land by 7 - 449 × 0.014 = 0.714 s, not the 1 s deadline."""
    policy = learned([completed()] * 180 + [canceled(7.0)] * 20)
    d = decide(make_replica("a", **KV_SHORT), cost=make_cost(**LONG), policy=policy)
    assert d == Queue(pytest.approx(7.0 - 449 * 0.014 - KV_OWN_PREFILL_S), "kv_wait",
                      pytest.approx(KV_WAIT_S + KV_OWN_PREFILL_S))
    assert decide(make_replica("a", **KV_SHORT), cost=make_cost(**LONG)) == Queue(
        pytest.approx(1.0 - KV_OWN_PREFILL_S), "kv_wait", pytest.approx(KV_WAIT_S + KV_OWN_PREFILL_S))


def test_patience_shorter_than_an_idle_replica_could_serve_is_not_applied():
    """4.95 s alone on an idle replica > 4 s patience: shedding it would not be the load's
    doing, so only the TTFT deadline holds."""
    policy = learned([completed()] * 180 + [canceled(4.0)] * 20)
    backlog = make_replica("a", **BACKLOG)
    assert decide(backlog, cost=make_cost(**LONG), policy=policy) == decide(
        backlog, cost=make_cost(**LONG))


def test_a_started_estimate_holds_while_cancellations_stop_then_lapses():
    """Cancellations falling below the share is what the check achieves: the estimate holds
    (dropping it let the guard fill the TTFT budget again until the next wave of abandoned
    requests), and lapses 60 s after the client's last cancellation."""
    backlog = make_replica("a", **BACKLOG)
    cost = make_cost(**LONG)
    rolled = learned(CANCELING + [completed()] * 200)  # the window rolled past the cancels
    assert rolled.patience.patience_s("interactive", 0.0, "acme") == pytest.approx(5.5)
    assert decide(backlog, cost=cost, policy=rolled) == Shed(503, "slo_unattainable")
    idle = learned(CANCELING)  # no outcome at all since
    assert idle.patience.patience_s("interactive", 60.0, "acme") == pytest.approx(5.5)
    assert idle.patience.patience_s("interactive", 60.5, "acme") is None
    late = make_cost(arrival_s=60.5, **LONG)
    assert decide(backlog, cost=late, now_s=60.5, policy=idle) == decide(backlog, cost=late,
                                                                         now_s=60.5)
    # once lapsed, it starts again only from the share: completions alone do not revive it
    idle.observe(completed(now_s=61.0))
    assert idle.patience.patience_s("interactive", 61.0, "acme") is None
    # newer cancellations while it holds keep its value current
    longer = learned(CANCELING + [completed(now_s=1.0)] * 150
                     + [canceled(8.0, now_s=2.0)] * 60)
    assert longer.patience.patience_s("interactive", 2.0, "acme") == pytest.approx(8.0)


def test_a_retry_cut_short_by_its_users_deadline_does_not_set_the_patience():
    """Kaplan–Meier over cancellations and completions: 5 attempts cancelled 0.6–1.0 s in (retries
    whose users' own deadlines ran out) are 5 drops among ~200 requests still running then; of
    the 22 still running at 9 s, 12 were abandoned at 9 s — the patience is 9 s. (The quarter
    of the cancellations alone would say 1.0 s.)"""
    history = ([completed(elapsed_s=3.0)] * 173 + [canceled(0.6 + 0.1 * i) for i in range(5)]
               + [canceled(9.0)] * 12 + [completed(elapsed_s=12.0)] * 10)
    assert learned(history).patience.patience_s("interactive", 0.0, "acme") == pytest.approx(9.0)
    # and once started, one such cancellation leaves the held value as it is
    held = learned(history + [completed(elapsed_s=3.0)] * 200 + [canceled(0.59)])
    assert held.patience.patience_s("interactive", 0.0, "acme") == pytest.approx(9.0)


def test_clients_that_outwait_the_cancellations_mean_no_patience_limit():
    """20 cancellations at 5.5 s, but 100 completions ran 10 s: of the 120 requests still
    running at 5.5 s only a sixth were abandoned — under the quarter: no estimate."""
    history = [completed(elapsed_s=10.0)] * 100 + [canceled(5.5)] * 20
    assert learned(history).patience.patience_s("interactive", 0.0, "acme") is None
    assert patience_quantile_s([(0.0, 5.5, True)] * 5 + [(0.0, 10.0, False)] * 15, 0.25) == 5.5
    assert patience_quantile_s([(0.0, 5.5, True)] * 4 + [(0.0, 10.0, False)] * 16, 0.25) is None
    assert patience_quantile_s([(0.0, None, True)] * 20, 0.25) is None  # unknown elapsed


def test_patience_is_learned_per_client_software_and_tenant():
    """A script on aiohttp that gives up after 5.5 s says nothing of the SDK app beside it:
    only the script's requests are held to its patience."""
    script = [dataclasses.replace(c, client="python") for c in CANCELING]
    policy = learned([dataclasses.replace(completed(), client="openai")] * 100 + script)
    assert policy.patience.patience_s("interactive", 0.0, "acme", "python") == pytest.approx(5.5)
    assert policy.patience.patience_s("interactive", 0.0, "acme", "openai") is None
    assert policy.patience.patience_s("interactive", 0.0, "other", "python") is None
    assert policy.client_patience(0.0) == {"interactive": pytest.approx(5.5)}
    backlog = make_replica("a", **BACKLOG)
    held = make_cost(client="python", **LONG)
    patient = make_cost(client="openai", **LONG)
    assert decide(backlog, cost=held, policy=policy) == Shed(503, "slo_unattainable")
    assert isinstance(decide(backlog, cost=patient, policy=policy), Admit)
    other_tenant = make_cost(client="python", tenant="other", **LONG)
    assert isinstance(decide(backlog, cost=other_tenant, policy=policy), Admit)


def test_client_software_is_the_user_agents_first_product():
    assert client_software("OpenAI/Python 1.54.0") == "openai"
    assert client_software("Python/3.12 aiohttp/3.9.5") == "python"
    assert client_software("curl/8.5.0") == "curl"
    assert client_software("  Mozilla/5.0 (X11)") == "mozilla"
    assert client_software("lonely") == "lonely"
    assert client_software(None) == client_software("") == ""
    assert len(client_software("x" * 500)) == 32


def test_client_software_answers_are_kept_per_agent_and_the_table_is_bounded():
    import policies.client_patience as cp

    cp._KNOWN_AGENTS.clear()
    assert client_software("OpenAI/Python 1.54.0") == "openai"
    assert cp._KNOWN_AGENTS == {"OpenAI/Python 1.54.0": "openai"}
    assert client_software("OpenAI/Python 1.54.0") == "openai"  # from the table
    for i in range(cp.MAX_KNOWN_AGENTS * 3):  # a client that makes up agents grows nothing
        assert client_software(f"bot{i}/1.0") == f"bot{i}"
        assert len(cp._KNOWN_AGENTS) <= cp.MAX_KNOWN_AGENTS
    assert client_software(None) == client_software("") == ""


def test_client_keys_are_bounded():
    policy = learned([])
    for i in range(MAX_CLIENT_KEYS + 50):
        policy.observe(dataclasses.replace(completed(), client=f"app{i}"))
    assert len(policy.patience._clients) == MAX_CLIENT_KEYS
    assert ("interactive", "acme", "app0") not in policy.patience._clients
    assert ("interactive", "acme", f"app{MAX_CLIENT_KEYS + 49}") in policy.patience._clients


def test_only_the_clients_own_cancellations_count():
    guard_canceled = [completed()] * 180 + [canceled(5.5, client_left=False)] * 20
    policy = learned(guard_canceled)
    assert policy.patience.patience_s("interactive", 0.0, "acme") is None
    failed = dataclasses.replace(make_sample(ok=False), outcome="failed", elapsed_s=5.5)
    assert learned([completed()] * 180 + [failed] * 20).patience.patience_s(
        "interactive", 0.0, "acme") is None


@pytest.mark.parametrize("params", [
    dict(patience_quantile=0.0), dict(patience_quantile=1.5), dict(min_cancel_share=0.0),
    dict(min_cancel_share=float("nan")),
])
def test_bad_patience_params_are_refused(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        SloPolicy(**params)


def test_the_decode_time_recent_completions_saw_counts_when_it_is_longer_than_the_forecast():
    """Completions took 20 ms per token after the first (the forecast join step is 11 ms): 449
    such steps take 8.98 s, past the 5.5 s patience, even from an idle replica's 0.0132 s."""
    slow = dataclasses.replace(make_sample(ttft_s=0.1, output=8), elapsed_s=0.1 + 7 * 0.02)
    fast = dataclasses.replace(make_sample(ttft_s=0.1, output=8), elapsed_s=0.1 + 7 * 0.005)
    cancels = [canceled(5.5)] * 20
    idle, cost = make_replica("a"), make_cost(**LONG)
    assert decide(idle, cost=cost, policy=learned([slow] * 180 + cancels)) == Shed(
        503, "slo_unattainable")
    assert decide(idle, cost=cost, policy=learned([fast] * 180 + cancels)) == Admit(
        "a", pytest.approx(0.0132))  # faster than the forecast: the forecast step holds
    assert learned([slow] * 180 + cancels).patience.estimate("interactive", 0.0, "acme") == (
        5.5, pytest.approx(0.02), False)


def test_the_decode_pace_is_the_latest_streams_abandoned_ones_included():
    """A burst slows every stream from 5 ms to 20 ms a token. The window still holds 180 quiet
    completions, but the latest 16 streams — abandoned mid-stream, the completions being the
    short ones that got away — saw 20 ms: that pace decides, and the request is shed."""
    fast = dataclasses.replace(make_sample(ttft_s=0.1, output=8), elapsed_s=0.1 + 7 * 0.005)
    abandoned = [canceled(5.5, ttft_s=0.5, output=251) for _ in range(20)]   # 5 s / 250 = 20 ms
    idle, cost = make_replica("a"), make_cost(**LONG)
    burst = learned([fast] * 180 + abandoned)
    assert burst.patience.estimate("interactive", 0.0, "acme") == (5.5, pytest.approx(0.02), False)
    assert decide(idle, cost=cost, policy=burst) == Shed(503, "slo_unattainable")
    # the same 200 outcomes with the quiet completions last: 5 ms, below the forecast step
    quiet = learned(abandoned + [fast] * 180)
    assert quiet.patience.estimate("interactive", 0.0, "acme").decode_step_s == pytest.approx(0.005)
    assert decide(idle, cost=cost, policy=quiet) == Admit("a", pytest.approx(0.0132))


def test_while_answers_run_to_max_tokens_a_request_is_priced_at_its_own():
    """Completions that used their whole max_tokens say nothing of how long a longer request
    runs; under patience pressure they are the short requests that finished. 400 max_tokens
    (learned expectation 200): 199 × 20 ms fits the 5.5 s patience, 399 × 20 ms does not,
    and alone on the idle replica it would (399 × the 11 ms step)."""
    def done(max_tokens):
        return dataclasses.replace(make_sample(ttft_s=0.1, output=8), elapsed_s=0.1 + 7 * 0.02,
                                   max_tokens=max_tokens)
    cancels = [canceled(5.5)] * 20
    idle, cost = make_replica("a"), make_cost(max_tokens=400, num_blocks=4)
    assert cost.num_expected_output_tokens == 200
    capped = learned([done(8)] * 180 + cancels)
    assert capped.patience.estimate("interactive", 0.0, "acme").runs_to_max_tokens
    assert decide(idle, cost=cost, policy=capped) == Shed(503, "slo_unattainable")
    natural = learned([done(64)] * 180 + cancels)      # stopped on their own before the limit
    assert not natural.patience.estimate("interactive", 0.0, "acme").runs_to_max_tokens
    assert isinstance(decide(idle, cost=cost, policy=natural), Admit)
