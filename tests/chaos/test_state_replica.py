"""The state-only replica: steps, blocks and tokens on an injected clock, exact numbers."""

from __future__ import annotations

import pytest

from chaos.state_replica import StateReplica
from guard.replicas.load_state import LoadState
from policies.step_time_fitter import prior_from_timing_model


def step_s(num_prefill: int, num_decode: int, num_context: int) -> float:
    return 0.01 + 0.001 * num_decode + 0.0001 * num_prefill  # 10 ms a step, plus the work


def make(**kw) -> StateReplica:
    params = {"num_total_blocks": 100, "block_size": 4, "max_num_seqs": 2,
              "max_num_batched_tokens": 8, "max_model_len": 64}
    params.update(kw)
    return StateReplica(step_s, **params)


def test_a_request_prefills_in_chunks_then_decodes_to_its_max_tokens():
    replica, got = make(), []
    replica.submit("a", 10, 3, lambda n, done: got.append((n, done)), now_s=1.0)
    replica.advance_to(1.0)  # step 1 scheduled: an 8-token chunk
    assert got == [] and replica.running[0].num_blocks == 2
    replica.advance_to(1.0108)  # step 1 ends at 1.0108; step 2: the last 2 prompt tokens
    assert got == [] and replica.state()["running"][0]["num_prefill_tokens_remaining"] == 2
    replica.advance_to(1.0108 + 0.0102)  # the step finishing the prompt samples token 1
    assert got == [(1, False)]
    replica.advance_to(10.0)
    assert got == [(1, False), (1, False), (1, True)]
    assert replica.num_free_blocks == 100 and replica.running == []
    assert [it["num_prefill_tokens"] for it in replica.iterations] == [8, 2, 0, 0]
    assert [it["num_decode_seqs"] for it in replica.iterations] == [0, 0, 1, 1]


def test_sequence_slots_hold_back_the_third_request():
    replica = make()
    for rid in "abc":
        replica.submit(rid, 2, 2, lambda n, done: None, now_s=0.0)
    replica.advance_to(0.0)
    state = replica.state()
    assert [s["request_id"] for s in state["running"]] == ["a", "b"]
    assert [s["request_id"] for s in state["waiting"]] == ["c"]


def test_a_sequence_without_a_free_block_waits_and_abort_frees_its_blocks():
    replica = make(num_total_blocks=3)
    replica.submit("a", 8, 8, lambda n, done: None, now_s=0.0)
    replica.submit("b", 8, 8, lambda n, done: None, now_s=0.0)
    replica.advance_to(0.0)  # a takes 2 blocks for its prompt; b's chunk needs 2, 1 is left
    assert replica.num_free_blocks == 1
    assert replica.state()["running"][1]["num_prefill_tokens_remaining"] == 8
    replica.abort("a")
    assert replica.num_free_blocks == 3


def test_bad_requests_and_limits_are_refused_by_name():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        make().submit("a", 60, 10, lambda n, done: None, now_s=0.0)


def test_the_guard_reads_its_state_document():
    replica = make()
    replica.submit("a", 10, 3, lambda n, done: None, now_s=0.0)
    replica.advance_to(0.025)  # the prompt is in, the first token out, the next step running
    snapshot = LoadState().update_from_kvguard_state("r0", replica.state(), 0.025)
    assert snapshot.num_free_blocks == replica.num_free_blocks
    assert len(snapshot.running) == 1 and snapshot.running[0].num_context_tokens == 11


def test_a_time_scale_stretches_every_step_and_the_document_says_so():
    plain, slow, got = make(), make(time_scale=3.0), []
    for replica in (plain, slow):
        replica.submit("a", 10, 3, lambda n, done, r=replica: got.append((r, n, done)),
                       now_s=0.0)
        replica.advance_to(100.0)
    assert [it["duration_s"] for it in slow.iterations] == pytest.approx(
        [3 * it["duration_s"] for it in plain.iterations])
    assert slow.iterations[-1]["end_s"] == pytest.approx(3 * plain.iterations[-1]["end_s"])
    assert (plain.state()["time_scale"], slow.state()["time_scale"]) == (1.0, 3.0)
    prior = {"base_s": 0.01, "per_prefill_token_s": 1e-4, "per_decode_seq_s": 1e-3,
             "per_context_token_s": 0.0}
    plain_prior, slow_prior = (prior_from_timing_model(prior, r.state()["time_scale"])
                               for r in (plain, slow))
    assert slow_prior.base_s == pytest.approx(3 * plain_prior.base_s)
    with pytest.raises(ValueError, match="time_scale"):
        make(time_scale=0)
