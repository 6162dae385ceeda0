"""Pricing and routing by the prefix cache: a replica that holds a request's prefix is priced
with fewer new blocks and less prefill, and ``slo`` prefers it until it saturates.
STEP: 10 ms + 0.1 ms per prefill token + 1 ms per decoding seq."""

import dataclasses

import pytest
from policy_builders import STEP, decoding, make_cost, make_replica, make_snapshot

from policies.decision import Admit, Queue, Shed
from policies.predictor import forecast
from policies.prefill_pacing import prefill_fits_gaps
from policies.slo import SloPolicy
from policies.snapshot import QueuedAhead

# a 2,000-token prompt with 64 output tokens: 129 blocks of 16 cold
PROMPT, MAX_TOKENS = 2000, 64


def shared_prefix_cost(cached: dict[str, int] | None):
    cost = make_cost(prompt=PROMPT, max_tokens=MAX_TOKENS)
    return dataclasses.replace(cost, cached_prefix_tokens=cached)


def roomy(replica_id: str, **kwargs):
    args = dict(free=400, total=600, max_model_len=4096, max_num_batched_tokens=512)
    args.update(kwargs)
    return make_replica(replica_id, **args)


def test_cached_tokens_count_whole_blocks_and_never_the_last_prompt_token():
    cost = shared_prefix_cost({"a": 1900, "b": 5000})
    assert cost.num_cached_tokens_on("a", 16) == 1888  # 118 whole blocks
    assert cost.num_cached_tokens_on("b", 16) == 1984  # capped at prompt - 1, whole blocks
    assert cost.num_cached_tokens_on("c", 16) == 0
    assert cost.num_new_blocks_on("a", 16) == 129 - 118
    assert cost.num_uncached_prompt_tokens_on("a", 16) == 112
    assert shared_prefix_cost(None).num_new_blocks_on("a", 16) == 129


def test_a_cached_prefix_is_priced_with_fewer_new_blocks_and_less_prefill():
    cost = shared_prefix_cost({"a": 1900})
    on_a = forecast(cost, roomy("a"), STEP)
    on_b = forecast(cost, roomy("b"), STEP)
    # b prefills 2,000 tokens in 4 chunks of 512; a its 112 uncached ones in one
    assert on_b.own_prefill_s == pytest.approx(4 * 0.01 + 2000 * 0.0001)
    assert on_a.own_prefill_s == pytest.approx(0.01 + 112 * 0.0001)
    # 15 free blocks, 3 of them committed to the running stream's growth: a's 11 new blocks
    # fit now, b's 129 do not
    tight = dict(free=15, running=[decoding(32, 40)])
    assert forecast(cost, roomy("a", **tight), STEP).num_missing_blocks == 0
    assert forecast(cost, roomy("b", **tight), STEP).num_missing_blocks > 0
    # the batch once joined reads the whole context either way
    assert on_a.join_step_s == on_b.join_step_s


def test_slo_routes_to_the_replica_holding_the_prefix_while_it_has_room():
    cost = shared_prefix_cost({"a": 1900})
    policy = SloPolicy(ttft_safety_ratio=1.0)
    # b is idle, a already runs two streams: the hit still wins
    a = roomy("a", running=[decoding(), decoding()])
    assert policy.decide(cost, make_snapshot(roomy("b"), a)).replica_id == "a"
    # without the view the idle replica wins
    assert policy.decide(shared_prefix_cost(None),
                         make_snapshot(roomy("b"), a)).replica_id == "b"


def test_slo_breaks_affinity_once_the_replica_holding_the_prefix_saturates():
    cost = shared_prefix_cost({"a": 1900})
    policy = SloPolicy(ttft_safety_ratio=1.0)
    # a's blocks are all committed to its running streams: the 11 new ones must wait
    full = roomy("a", free=4, running=[decoding(32, 200)] * 4)
    assert policy.decide(cost, make_snapshot(full, roomy("b"))) == Admit(
        "b", pytest.approx(4 * 0.01 + 2000 * 0.0001))
    # a full sequence table too: a's seats are all taken
    seats = roomy("a", running=[decoding()] * 8)
    assert policy.decide(cost, make_snapshot(seats, roomy("b"))).replica_id == "b"


def test_prefill_pacing_counts_only_the_uncached_prompt():
    # 7 decoding streams with a 25 ms ITL leave 8 ms for prefill: 80 tokens at 0.1 ms each
    streams = [decoding(itl_s=0.025)] * 7
    a = roomy("a", running=streams, waiting=[dataclasses.replace(decoding(), num_context_tokens=0,
                                                                 num_prefill_tokens_remaining=8)])
    cold = make_cost(prompt=200, max_tokens=8)
    warm = dataclasses.replace(cold, cached_prefix_tokens={"a": 192})  # 8 tokens to compute
    assert not prefill_fits_gaps(cold, a, STEP, 0.0)
    assert prefill_fits_gaps(warm, a, STEP, 0.0)


def test_affinity_wins_within_the_forecast_margin_and_lets_go_beyond_it():
    """b holds a quarter of the prompt but runs a long prefill backlog; a holds less and is
    idle. Within 20 % of the lowest forecast the warmer replica wins; past it the faster."""
    policy = SloPolicy(ttft_safety_ratio=1.0, cache_affinity_ratio=0.2)
    a = roomy("a")
    cost = shared_prefix_cost({"a": 16, "b": 512})
    near = roomy("b", waiting=[dataclasses.replace(decoding(), num_context_tokens=0,
                                                   num_prefill_tokens_remaining=600)])
    f_a, f_b = forecast(cost, a, STEP), forecast(cost, near, STEP, now_s=0.0)
    assert f_a.ttft_s < f_b.ttft_s <= 1.2 * f_a.ttft_s  # the setup: b slower, within 20 %
    assert policy.decide(cost, make_snapshot(a, near)).replica_id == "b"
    assert SloPolicy(ttft_safety_ratio=1.0, cache_affinity_ratio=0.0).decide(
        cost, make_snapshot(a, near)).replica_id == "a"
    far = roomy("b", waiting=[dataclasses.replace(decoding(), num_context_tokens=0,
                                                  num_prefill_tokens_remaining=1500)])
    assert forecast(cost, far, STEP, now_s=0.0).ttft_s > 1.2 * f_a.ttft_s
    assert policy.decide(cost, make_snapshot(a, far)).replica_id == "a"


def test_by_default_affinity_holds_for_as_long_as_the_warm_replica_fits():
    policy = SloPolicy(ttft_safety_ratio=1.0)
    cost = shared_prefix_cost({"b": 512})
    far = roomy("b", waiting=[dataclasses.replace(decoding(), num_context_tokens=0,
                                                  num_prefill_tokens_remaining=1500)])
    assert policy.decide(cost, make_snapshot(roomy("a"), far)).replica_id == "b"
    # once it no longer fits now (its seats all taken), the cold replica gets it
    full = roomy("b", running=[decoding()] * 8)
    assert policy.decide(cost, make_snapshot(roomy("a"), full)).replica_id == "a"


def test_a_warm_replica_held_back_only_by_prefill_pacing_is_waited_for():
    # b holds the prefix but its running streams' next step is full of pending prefill:
    # the request waits (itl_wait) rather than prefilling the prefix cold on a
    streams = [decoding(itl_s=0.025)] * 7
    pending = dataclasses.replace(decoding(), num_context_tokens=0,
                                  num_prefill_tokens_remaining=200)
    busy = roomy("b", running=streams, waiting=[pending], max_num_seqs=16)
    cost = shared_prefix_cost({"b": 1984})
    decision = SloPolicy(ttft_safety_ratio=1.0).decide(cost, make_snapshot(roomy("a"), busy))
    assert isinstance(decision, Queue) and decision.reason == "itl_wait"
    # nothing pending there: admitted to it at once
    idle_streams = roomy("b", running=streams, max_num_seqs=16)
    assert SloPolicy(ttft_safety_ratio=1.0).decide(
        cost, make_snapshot(roomy("a"), idle_streams)).replica_id == "b"


def test_on_a_ranked_fleet_the_replica_holding_the_prefix_is_a_candidate_wherever_it_ranks():
    """40 replicas: the bounded candidate set forecasts the 8 best-ranked and 4 sampled ones;
    the replica holding the prefix ranks last (it runs streams) and is still the one chosen,
    as the full scan chooses it."""
    from policies.candidates import RankedFleet

    idle = [roomy(f"r{i}") for i in range(39)]
    warm = roomy("warm", running=[decoding(), decoding()])
    replicas = (*idle, warm)
    ranked = RankedFleet.of(replicas, STEP, 0.0)
    assert ranked.ranked[-1].replica_id == "warm"
    cost = shared_prefix_cost({"warm": 1900})
    bounded = dataclasses.replace(make_snapshot(*replicas), fleet=ranked)
    full = make_snapshot(*replicas)
    policy = SloPolicy(ttft_safety_ratio=1.0)
    assert policy.decide(cost, full).replica_id == "warm"
    assert policy.decide(cost, bounded).replica_id == "warm"


def test_a_waiter_ahead_counts_only_on_the_replicas_expected_to_take_it():
    """``QueuedAhead``: a waiter expected on given replicas (where its prefix is) is ahead of a
    request forecast there only; one expected anywhere is ahead of it everywhere."""
    ahead = QueuedAhead().plus(100, 11, ("a", "b")).plus(2100, 136)
    assert (ahead.num_requests, ahead.num_prefill_tokens, ahead.num_blocks) == (2, 2200, 147)
    assert ahead.on("a") == ahead.on("b") == (2, 2200, 147)
    assert ahead.on("c") == (1, 2100, 136)
    assert QueuedAhead(3, 30, 6).on("c") == (3, 30, 6)  # no waiter held anywhere
    assert QueuedAhead().plus(50, 5, ("a",), num_requests=2).on("a") == (2, 50, 5)


def test_the_forecast_leaves_out_the_waiters_expected_on_other_replicas():
    cost = shared_prefix_cost({"a": 1900})
    on_b = QueuedAhead().plus(4000, 40, ("b",), num_requests=2)
    anywhere = QueuedAhead(2, 4000, 40)
    assert forecast(cost, roomy("a"), STEP, on_b) == forecast(cost, roomy("a"), STEP)
    assert forecast(cost, roomy("b"), STEP, on_b) == forecast(cost, roomy("b"), STEP, anywhere)


@pytest.mark.parametrize(("ahead", "expected"), [
    (QueuedAhead().plus(20000, 10, ("b",), num_requests=10), Queue),  # all bound for b
    (QueuedAhead().plus(20000, 10, ("a",), num_requests=10), Shed),  # all bound for a
    (QueuedAhead(10, 20000, 10), Shed),  # cached nowhere: they may go to a
])
def test_the_fast_no_counts_the_queue_where_its_waiters_will_go(ahead, expected):
    """Not admissible on a now (the join step is over a running stream's ITL). Behind 20,000
    prompt tokens of waiters that will prefill on a, its earliest first token is past the
    deadline: shed now. Behind the same waiters bound for b (their prefix is there), a's
    prefill backlog is its own: queued (b, whose state is stale, is not forecast at all)."""
    strict = make_replica("a", running=[decoding(itl_s=0.0115)])
    stale_b = make_replica("b", observed_s=-10.0)
    d = SloPolicy().decide(make_cost(), make_snapshot(strict, stale_b, queued_ahead=ahead))
    assert isinstance(d, expected)
