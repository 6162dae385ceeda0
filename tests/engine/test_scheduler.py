"""Scheduler on CPU with fabricated runner outputs: exact entries, block ids, and preemption."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

_order = itertools.count()


def make(num_blocks: int, block_size: int = 4, eos=(), detokenize=None, **config):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), bm, eos, detokenize), bm


def seq(request_id: str, num_prompt: int, max_tokens: int = 4, arrival_s: float = 0.0,
        priority: int = 0, **params) -> Sequence:
    prompt = tuple(range(100, 100 + num_prompt))
    return Sequence(request_id, prompt, SamplingParams.greedy_params(max_tokens, **params),
                    priority, arrival_s, next(_order))


def step(sched: Scheduler, sampled: dict[str, int] | None = None) -> SchedulerOutput:
    """Schedule, fabricate the runner's answer (token 1 unless given), update, check."""
    out = sched.schedule()
    sampled = sampled or {}
    answer = {e.request_id: sampled.get(e.request_id, 1) for e in out.scheduled if e.samples}
    sched.update(out, answer)
    sched.check_invariants()
    return out


def entries(out: SchedulerOutput) -> list[tuple]:
    return [(e.request_id, e.num_computed_tokens, e.num_new_tokens, e.block_ids, e.samples)
            for e in out.scheduled]


def assert_empty(sched: Scheduler, bm: BlockManager) -> None:
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(count == 0 for count in bm.pool.ref_counts)
    sched.check_invariants()


def test_chunked_prefill_then_decode_with_exact_blocks_and_counts():
    sched, bm = make(num_blocks=8, max_num_batched_tokens=8)
    a = seq("a", 10, max_tokens=3)
    sched.add(a)
    out = step(sched)
    assert entries(out) == [("a", 0, 8, (0, 1), False)]
    assert out.scheduled[0].token_ids == tuple(range(100, 108))
    assert (out.num_prefill_tokens, out.num_decode_seqs, out.num_context_tokens) == (8, 0, 0)
    out = step(sched, {"a": 500})
    assert entries(out) == [("a", 8, 2, (0, 1, 2), True)]
    assert out.num_prefill_tokens == 2
    out = step(sched, {"a": 501})
    assert entries(out) == [("a", 10, 1, (0, 1, 2), True)]
    assert out.scheduled[0].token_ids == (500,)
    assert (out.num_prefill_tokens, out.num_decode_seqs, out.num_context_tokens) == (0, 1, 10)
    out = step(sched, {"a": 502})
    assert a.output_token_ids == [500, 501, 502]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert sched.schedule().finished_request_ids == ("a",)
    assert_empty(sched, bm)


def test_running_first_then_waiting_within_the_token_budget():
    sched, bm = make(num_blocks=16, max_num_batched_tokens=8)
    sched.add(seq("a", 6, arrival_s=0.0))
    sched.add(seq("b", 6, arrival_s=1.0))
    assert entries(step(sched)) == [("a", 0, 6, (0, 1), True), ("b", 0, 2, (2,), False)]
    assert entries(step(sched)) == [("a", 6, 1, (0, 1), True), ("b", 2, 4, (2, 3), True)]
    sched.add(seq("c", 9, arrival_s=2.0))
    out = step(sched)
    assert entries(out) == [("a", 7, 1, (0, 1), True), ("b", 6, 1, (2, 3), True),
                            ("c", 0, 6, (4, 5), False)]
    assert (out.num_prefill_tokens, out.num_decode_seqs, out.num_context_tokens) == (6, 2, 13)


def test_max_num_seqs_holds_later_requests_back():
    sched, bm = make(num_blocks=16, max_num_seqs=1)
    sched.add(seq("a", 3, max_tokens=2))
    sched.add(seq("b", 3, max_tokens=2, arrival_s=1.0))
    assert [e.request_id for e in step(sched).scheduled] == ["a"]
    assert [e.request_id for e in step(sched).scheduled] == ["a"]
    assert [e.request_id for e in step(sched).scheduled] == ["b"]


def test_fcfs_orders_by_arrival_time_not_insertion():
    sched, _ = make(num_blocks=16, max_num_seqs=1)
    sched.add(seq("late", 3, arrival_s=5.0))
    sched.add(seq("early", 3, arrival_s=1.0))
    assert [e.request_id for e in step(sched).scheduled] == ["early"]


def test_preemption_by_recompute_frees_the_latest_arrival_and_replays_its_tokens():
    sched, bm = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = seq("a", 7, max_tokens=4, arrival_s=0.0), seq("b", 7, max_tokens=4, arrival_s=1.0)
    sched.add(a)
    sched.add(b)
    assert entries(step(sched, {"a": 11, "b": 21})) == [("a", 0, 7, (0, 1), True),
                                                        ("b", 0, 7, (2, 3), True)]
    assert entries(step(sched, {"a": 12, "b": 22})) == [("a", 7, 1, (0, 1), True),
                                                        ("b", 7, 1, (2, 3), True)]
    out = step(sched, {"a": 13})  # a needs a third block: b is preempted
    assert entries(out) == [("a", 8, 1, (0, 1, 2), True)]
    assert out.preempted_request_ids == ("b",) and out.finished_request_ids == ()
    assert sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [21, 22] and bm.block_table("b") == []
    assert entries(step(sched, {"a": 14})) == [("a", 9, 1, (0, 1, 2), True)]  # b does not fit
    assert a.status is SequenceStatus.FINISHED_LENGTH
    out = step(sched, {"b": 23})
    assert out.finished_request_ids == ("a",)
    assert entries(out) == [("b", 0, 9, (3, 0, 1), True)]
    assert out.scheduled[0].token_ids == tuple(range(100, 107)) + (21, 22)
    assert out.num_prefill_tokens == 9
    step(sched, {"b": 24})
    assert b.output_token_ids == [21, 22, 23, 24]
    assert_empty(sched, bm)


def _two_running_then_squeeze(policy: str) -> str:
    """Two running requests fill the pool; the third decode step must preempt one."""
    sched, _ = make(num_blocks=4, policy=policy)
    sched.add(seq("early_low", 7, max_tokens=4, arrival_s=0.0, priority=5))
    sched.add(seq("late_high", 7, max_tokens=4, arrival_s=1.0, priority=0))
    step(sched)
    step(sched)
    step(sched)
    assert sched.num_preemptions == 1
    [victim] = sched.waiting
    return victim.request_id


def test_priority_policy_preempts_the_least_important_fcfs_the_latest():
    assert _two_running_then_squeeze("priority") == "early_low"
    assert _two_running_then_squeeze("fcfs") == "late_high"


def test_priority_policy_admits_the_most_important_first():
    sched, _ = make(num_blocks=16, max_num_seqs=1, policy="priority")
    sched.add(seq("low", 3, priority=3, arrival_s=0.0))
    sched.add(seq("high", 3, priority=-1, arrival_s=1.0))
    assert [e.request_id for e in step(sched).scheduled] == ["high"]


def test_abort_in_every_state_frees_blocks():
    sched, bm = make(num_blocks=16, max_num_batched_tokens=8)
    for request_id, arrival in (("decoding", 0.0), ("prefilling", 1.0), ("waiting", 2.0)):
        sched.add(seq(request_id, 6 if request_id == "decoding" else 12, max_tokens=8,
                      arrival_s=arrival))
    step(sched)  # decoding: 6 prompt tokens; prefilling: 2 of 12
    step(sched)
    assert sched.get("decoding").num_output_tokens == 2
    assert 0 < sched.get("prefilling").num_computed_tokens < 12
    assert sched.get("waiting").status is SequenceStatus.WAITING
    for request_id in ("prefilling", "waiting", "decoding"):
        seq_ = sched.abort(request_id)
        assert seq_.status is SequenceStatus.FINISHED_ABORTED
        assert bm.block_table(request_id) == []
        sched.check_invariants()
    assert sched.abort("decoding") is None
    assert set(sched.schedule().finished_request_ids) == {"prefilling", "waiting", "decoding"}
    assert_empty(sched, bm)


def test_stop_rules_report_their_reasons():
    detok = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731
    sched, _ = make(num_blocks=32, eos=(7,), detokenize=detok)
    seqs = {"eos": seq("eos", 2, max_tokens=5), "ignore": seq("ignore", 2, max_tokens=2, ignore_eos=True),
            "stop_id": seq("stop_id", 2, max_tokens=5, stop_token_ids=(9,)),
            "stop_str": seq("stop_str", 2, max_tokens=5, stop=("cd",))}
    for s in seqs.values():
        sched.add(s)
    step(sched, {"eos": 3, "ignore": 7, "stop_id": 4, "stop_str": 2})
    assert all(s.status is SequenceStatus.RUNNING for s in seqs.values())
    step(sched, {"eos": 7, "ignore": 7, "stop_id": 9, "stop_str": 3})
    assert {k: s.status.finish_reason for k, s in seqs.items()} == {
        "eos": "stop", "ignore": "length", "stop_id": "stop", "stop_str": "stop"}


def test_invariants_hold_under_random_load_with_aborts():
    for seed in range(3):
        rng = random.Random(seed)
        sched, bm = make(num_blocks=12, max_num_batched_tokens=10, max_num_seqs=4)
        ids = iter(range(10_000))
        for _ in range(120):
            if rng.random() < 0.4:
                sched.add(seq(f"r{next(ids)}", rng.randint(1, 20), rng.randint(1, 8),
                              arrival_s=rng.random()))
            if rng.random() < 0.1 and (sched.running or sched.waiting):
                victim = rng.choice(sched.running + sched.waiting)
                sched.abort(victim.request_id)
            step(sched)
        while sched.has_unfinished():
            step(sched)
        assert_empty(sched, bm)


def test_a_runner_that_skips_a_sampling_request_is_an_error_not_corruption():
    sched, _ = make(num_blocks=8)
    a = seq("a", 3)
    sched.add(a)
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="no token"):
        sched.update(out, {})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    sched.check_invariants()


def _short(sched: Scheduler, out: SchedulerOutput) -> list[tuple]:
    return [(e.request_id, e.num_computed_tokens, e.num_new_tokens, e.samples)
            for e in out.scheduled]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_stall_free_long_prompts_arriving_over_running_decodes(policy):
    """Running decodes are scheduled every step; long prompts (more important ones too, under
    the priority policy) get only the budget the decodes leave, in chunks."""
    sched, bm = make(num_blocks=64, max_num_batched_tokens=8, policy=policy)
    sched.add(seq("a", 3, max_tokens=8, arrival_s=0.0, priority=1))
    sched.add(seq("b", 3, max_tokens=8, arrival_s=0.1, priority=1))
    assert _short(sched, step(sched)) == [("a", 0, 3, True), ("b", 0, 3, True)]
    sched.add(seq("long1", 14, arrival_s=1.0, priority=0))
    assert _short(sched, step(sched)) == [("a", 3, 1, True), ("b", 3, 1, True),
                                          ("long1", 0, 6, False)]
    sched.add(seq("long2", 9, arrival_s=2.0, priority=0))
    assert _short(sched, step(sched)) == [("a", 4, 1, True), ("b", 4, 1, True),
                                          ("long1", 6, 6, False)]
    assert _short(sched, step(sched)) == [("a", 5, 1, True), ("b", 5, 1, True),
                                          ("long1", 12, 2, True), ("long2", 0, 4, False)]
    decodes = [("a", 6, 1, True), ("b", 6, 1, True), ("long1", 14, 1, True)]
    if policy == "priority":  # decodes in priority order: long1 is the most important
        decodes = decodes[2:] + decodes[:2]
    assert _short(sched, step(sched)) == [*decodes, ("long2", 4, 5, True)]
    decodes = [("a", 7, 1, True), ("b", 7, 1, True), ("long1", 15, 1, True),
               ("long2", 9, 1, True)]
    if policy == "priority":
        decodes = decodes[2:] + decodes[:2]
    assert _short(sched, step(sched)) == decodes
    while sched.has_unfinished():
        step(sched)
    assert_empty(sched, bm)


def test_a_recomputing_earlier_arrival_does_not_stall_later_decodes():
    """After preemption the victim re-prefills; running decodes that arrived after it still
    run every step while its recompute takes the leftover budget."""
    sched, bm = make(num_blocks=64, max_num_batched_tokens=6)
    old = seq("old", 10, max_tokens=8, arrival_s=0.0)
    sched.add(old)
    step(sched)
    step(sched)  # old: prompt done, first token sampled
    sched.add(seq("new", 2, max_tokens=8, arrival_s=1.0))
    step(sched)
    sched._preempt(old)  # as a block shortage would: its KV is gone, its 2 tokens kept
    out = step(sched)
    assert _short(sched, out) == [("new", 2, 1, True), ("old", 0, 5, False)]
    assert _short(sched, step(sched)) == [("new", 3, 1, True), ("old", 5, 5, False)]
    assert _short(sched, step(sched)) == [("new", 4, 1, True), ("old", 10, 2, True)]


def test_running_sequences_are_capped_by_the_token_budget_so_decodes_fit():
    sched, bm = make(num_blocks=64, max_num_batched_tokens=3, max_num_seqs=8)
    for i in range(5):
        sched.add(seq(f"r{i}", 1, max_tokens=4, arrival_s=float(i)))
    assert [e.request_id for e in step(sched).scheduled] == ["r0", "r1", "r2"]
    assert [e.request_id for e in step(sched).scheduled] == ["r0", "r1", "r2"]


def test_stall_free_invariant_under_random_long_prompts_and_preemption():
    rng = random.Random(7)
    sched, bm = make(num_blocks=24, max_num_batched_tokens=10, max_num_seqs=6,
                     policy="priority")
    for i in range(300):
        if rng.random() < 0.3:
            sched.add(seq(f"q{i}", rng.choice([2, 5, 30, 60]), max_tokens=rng.randint(1, 12),
                          arrival_s=float(i), priority=rng.randint(0, 2)))
        decoding = {s.request_id for s in sched.running if s.num_uncomputed_tokens == 1}
        preempted_before = sched.num_preemptions
        out = step(sched)
        scheduled = {e.request_id for e in out.scheduled}
        stalled = decoding - scheduled - set(out.preempted_request_ids)
        assert not stalled, f"step {i}: decodes {stalled} were skipped"
        if sched.num_preemptions == preempted_before:
            assert decoding <= scheduled
