"""Hand-computed forecasts. STEP: 10 ms + 0.1 ms per prefill token + 1 ms per decoding seq."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import STEP, decoding, make_cost, make_replica, prompt_waiting

from policies.predictor import forecast, never_fits, predict_ttft_s, prefill_s
from policies.snapshot import NOTHING_AHEAD, QueuedAhead, SeqLoad
from policies.step_time import StepTimeModel


def test_idle_replica_ttft_is_one_prefill_step():
    # 32 prompt tokens in one chunk: 10 ms + 32 * 0.1 ms.
    assert predict_ttft_s(make_cost(), make_replica(), STEP) == pytest.approx(0.0132)
    f = forecast(make_cost(), make_replica(), STEP)
    assert (f.num_missing_blocks, f.num_missing_seqs, f.wait_s, f.queued_prefill_s) == (
        0,
        0,
        0.0,
        0.0,
    )
    assert f.join_step_s == pytest.approx(0.011)  # a batch of one


def test_running_batch_slows_each_prefill_step_and_sets_the_join_step():
    replica = make_replica(running=[decoding(), decoding()])
    f = forecast(make_cost(), replica, STEP)
    assert f.own_prefill_s == pytest.approx(0.012 + 0.0032)  # step with 2 decoding seqs + tokens
    assert f.join_step_s == pytest.approx(0.013)  # 3 seqs decoding
    assert not f.is_blocked


def test_queued_prefill_is_chunked_at_the_token_budget_minus_the_decode_batch():
    # Chunk = 64 - 2 = 62 tokens. Ahead: 100 tokens = 2 steps; with ours 132 tokens = 3 steps.
    replica = make_replica(running=[decoding(), decoding()], waiting=[prompt_waiting(100)])
    f = forecast(make_cost(), replica, STEP)
    assert f.queued_prefill_s == pytest.approx(2 * 0.012 + 100 * 0.0001)
    assert f.own_prefill_s == pytest.approx(0.012 + 32 * 0.0001)
    assert f.ttft_s == pytest.approx(3 * 0.012 + 132 * 0.0001)
    assert prefill_s(0, replica, STEP) == 0.0


def test_reserved_requests_count_as_queued_prefill():
    reserved = SeqLoad(
        num_context_tokens=0, num_prefill_tokens_remaining=50, num_remaining_output_tokens=8
    )
    replica = make_replica(reserved=[reserved], reserved_blocks=4)
    f = forecast(make_cost(), replica, STEP)
    # No decode batch: chunk 64. Ahead 50 tokens = 1 step; with ours 82 = 2 steps.
    assert f.queued_prefill_s == pytest.approx(0.010 + 0.005)
    assert f.ttft_s == pytest.approx(0.020 + 0.0082)


def test_kv_wait_until_enough_blocks_free():
    # Running seqs will grow into 1 + 1 + 3 = 5 more blocks, so 5 free blocks are all committed.
    # Finish order: 16 steps (3 blocks), 16 steps (3 blocks), 40 steps (4 blocks). The request
    # needs 4 blocks: after the second finisher (6 >= 4), i.e. 16 steps of 13 ms.
    running = [decoding(32, 16), decoding(32, 16), decoding(16, 40)]
    replica = make_replica(free=5, running=running)
    f = forecast(make_cost(), replica, STEP)
    assert (f.num_missing_blocks, f.num_missing_seqs) == (4, 0)
    assert f.is_blocked
    assert f.wait_s == pytest.approx(16 * 0.013)
    assert f.ttft_s == pytest.approx(16 * 0.013 + 0.013 + 0.0032)


def test_guard_reservations_take_blocks_first():
    replica = make_replica(free=10, reserved_blocks=8)
    f = forecast(make_cost(), replica, STEP)
    assert f.num_missing_blocks == 2


def test_no_free_blocks_and_nothing_running_has_no_wait_to_predict():
    f = forecast(make_cost(), make_replica(free=0), STEP)
    assert (f.num_missing_blocks, f.wait_s) == (4, 0.0)
    assert f.is_blocked


def test_seq_slot_wait_when_max_num_seqs_is_reached():
    replica = make_replica(max_num_seqs=2, running=[decoding(32, 40), decoding(32, 10)])
    f = forecast(make_cost(), replica, STEP)
    assert (f.num_missing_blocks, f.num_missing_seqs) == (0, 1)
    assert f.wait_s == pytest.approx(10 * 0.012)
    assert f.join_step_s == pytest.approx(0.012)  # the batch stays at max_num_seqs


def test_a_queue_deeper_than_the_batch_waits_for_each_seat_to_turn_over_a_whole_run():
    """Four seats, all taken, freeing after 3, 3, 5 and 7 steps; 4 requests queued ahead take
    those; this one gets the first seat again once the request that took it has run: its
    prefill (1 chunk) and its expected output (16 tokens) — not 3 more steps, as extrapolating
    by what the running batch has left said (and a flood queued until it was shed)."""
    from policies.snapshot import QueuedAhead

    running = [decoding(32, 3), decoding(32, 3), decoding(32, 5), decoding(32, 7)]
    replica = make_replica(max_num_seqs=4, running=running)
    first = forecast(make_cost(), replica, STEP)
    assert (first.num_missing_seqs, first.wait_s) == (1, pytest.approx(3 * 0.014))
    behind = forecast(make_cost(), replica, STEP, QueuedAhead(4, 128, 16))
    assert behind.num_missing_seqs == 5
    assert behind.wait_s == pytest.approx((3 + 1 + 16) * 0.014)
    seventh = forecast(make_cost(), replica, STEP, QueuedAhead(6, 192, 24))
    assert seventh.wait_s == pytest.approx((5 + 17) * 0.014)  # the third seat, second round


def test_the_wait_for_a_seat_is_timed_by_the_batch_that_holds_it():
    """Both seats are held by prompts not yet prefilled (nothing decodes now: a 10 ms step);
    they decode before they finish, so the steps waited are 2-sequence decode steps (12 ms)."""
    replica = make_replica(max_num_seqs=2, waiting=[prompt_waiting(100), prompt_waiting(100)])
    f = forecast(make_cost(), replica, STEP)
    (first_finish, _) = replica.load.finish_schedule.num_steps
    assert f.num_missing_seqs == 1 and first_finish > 0
    assert f.wait_s == pytest.approx(first_finish * 0.012)


def test_context_tokens_enter_the_step_time():
    from policies.step_time import StepTimeModel

    step = StepTimeModel(
        base_s=0.0, per_prefill_token_s=0.0, per_decode_seq_s=0.0, per_context_token_s=0.001
    )
    replica = make_replica(running=[decoding(ctx=100)], waiting=[prompt_waiting(50)])
    f = forecast(make_cost(), replica, step)
    assert f.join_step_s == pytest.approx((100 + 50 + 32) * 0.001)
    assert f.own_prefill_s == pytest.approx(0.1)  # one chunk step beside the 100-token batch


@pytest.mark.parametrize(
    ("cost", "replica"),
    [
        (make_cost(num_blocks=101), make_replica(total=100)),  # more blocks than the replica has
        (make_cost(prompt=1000, max_tokens=100), make_replica(max_model_len=1024, total=1000)),
    ],
)
def test_never_fits_is_none(cost, replica):
    assert forecast(cost, replica, STEP) is None
    assert predict_ttft_s(cost, replica, STEP) is None


def test_aggregates_are_computed_once_per_snapshot():
    replica = make_replica(running=[decoding()])
    assert replica.load is replica.load
    assert replica.load.finish_schedule is replica.load.finish_schedule


def test_degenerate_limits_do_not_crash():
    f = forecast(make_cost(), make_replica(max_num_seqs=0), STEP)
    assert (f.num_missing_seqs, f.wait_s) == (1, 0.0)
    assert f.is_blocked


# --- the one-function forecast equals its parts ---------------------------------------------
# forecast() inlines the step-time model, never_fits, the chunked prefill time and the idle
# case of pending_prefill_tokens (it runs per replica for every request on the proxy's path).
# This oracle is the forecast written with the helpers, term for term: the two must agree
# exactly, not approximately, on any state.


def _reference_forecast(cost, replica, step_time, ahead, now_s):
    from policies.predictor import TtftForecast, _steps_until_finished, _steps_until_freed
    from policies.prefill_pacing import pending_prefill_tokens

    if never_fits(cost, replica):
        return None
    load = replica.load
    chunk = max(1, replica.max_num_batched_tokens - load.num_decode_seqs)
    decode_s = step_time.step_s(0, load.num_decode_seqs, load.num_running_context_tokens)
    num_ahead, num_ahead_tokens, num_ahead_blocks = ahead.on(replica.replica_id)
    missing_blocks = (cost.num_blocks + num_ahead_blocks
                      - (replica.num_available_blocks - load.num_committed_blocks))
    missing_seqs = load.num_seqs + 1 + num_ahead - replica.max_num_seqs
    wait_s = 0.0
    if missing_blocks > 0 or missing_seqs > 0:
        run_steps = -(-cost.num_prompt_tokens // chunk) + max(1, cost.num_expected_output_tokens)
        wait_steps = max(_steps_until_freed(load, missing_blocks, run_steps),
                         _steps_until_finished(load, missing_seqs, run_steps))
        wait_s = wait_steps * step_time.step_s(0, min(replica.max_num_seqs, load.num_seqs),
                                               load.num_context_tokens)
    pending = (load.num_queued_prefill_tokens if now_s is None
               else pending_prefill_tokens(replica, step_time, now_s))
    num_queued = pending + num_ahead_tokens

    def prefill(n):
        return 0.0 if n <= 0 else -(-n // chunk) * decode_s + step_time.per_prefill_token_s * n

    queued_s = prefill(num_queued)
    total_s = prefill(num_queued + cost.num_prompt_tokens)
    join = min(replica.max_num_seqs, load.num_seqs + 1)
    return TtftForecast(max(0, missing_blocks), max(0, missing_seqs), wait_s, queued_s,
                        total_s - queued_s,
                        step_time.step_s(0, join, load.num_context_tokens + cost.num_prompt_tokens),
                        num_queued)


_seqs = st.lists(st.builds(SeqLoad, st.integers(0, 600), st.integers(0, 300), st.integers(0, 200),
                           st.none(), st.one_of(st.none(), st.floats(8.0, 10.5))), max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 900), st.integers(1, 400), st.integers(0, 200), st.integers(1, 200),
    _seqs, _seqs, _seqs, st.integers(0, 60), st.sampled_from([1, 4, 8, 64]),
    st.sampled_from([1, 16, 64, 512]), st.floats(0.0, 3.0),
    st.one_of(st.none(), st.builds(QueuedAhead, st.integers(1, 6), st.integers(0, 2000),
                                   st.integers(0, 100)),
              # waiters expected on this replica ("a") or on another one
              st.builds(lambda n, t, b, at: QueuedAhead().plus(t, b, (at,), n),
                        st.integers(1, 6), st.integers(0, 2000), st.integers(0, 100),
                        st.sampled_from(["a", "b"]))),
    st.sampled_from([STEP, StepTimeModel(0.004, 2e-6, 3e-5, 2e-8),
                     StepTimeModel(0.02, 0.0, 0.001, 1e-6)]),
    st.sampled_from([None, 10.0]),
)
def test_the_inlined_forecast_is_exactly_its_parts(prompt, max_tokens, free, total, running,
                                                    waiting, reserved, reserved_blocks,
                                                    max_num_seqs, batched, age, ahead, step,
                                                    now_s):
    cost = make_cost(prompt=prompt, max_tokens=max_tokens)
    replica = make_replica(free=min(free, total), total=total, running=running, waiting=waiting,
                           reserved=reserved, reserved_blocks=reserved_blocks,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                           observed_s=10.0 - age)
    ahead = ahead or NOTHING_AHEAD
    assert forecast(cost, replica, step, ahead, now_s) == _reference_forecast(
        cost, replica, step, ahead, now_s)
