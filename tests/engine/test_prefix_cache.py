"""The prefix cache with exact block ids: hits, misses, partial hits, LRU eviction, reference
counts, abort, preemption, and the KV events in order. Block manager alone, then the scheduler
with fabricated runner outputs."""

from __future__ import annotations

import itertools

import pytest

from engine.block_hash import prefix_block_hashes
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

BS = 4  # block size
NS = "m"  # hash namespace (model name)
_order = itertools.count()


def manager(num_blocks: int = 8) -> BlockManager:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, hash_namespace=NS)
    bm.pool.events = []
    return bm


def hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    return prefix_block_hashes(tokens, BS, NS, salt)


def compute(bm: BlockManager, rid: str, tokens: list[int], salt: str | None = None) -> list[int]:
    """Admit ``tokens`` as a request the way the scheduler does, compute them all, and return
    the cached blocks it started from."""
    hits = bm.find_cached_blocks(hashes(tokens, salt), (len(tokens) - 1) // BS)
    assert bm.allocate(rid, len(tokens), hits) is not None
    bm.cache_full_blocks(rid, hashes(tokens, salt), len(tokens),
                         lambda a, b: tokens[a:b])
    bm.check_invariants()
    return hits


A = list(range(10, 20))  # 10 tokens: blocks [10..13] [14..17] + 2 tokens


def test_full_computed_blocks_are_stored_once_with_one_event():
    bm = manager()
    assert compute(bm, "a", A) == []
    assert bm.block_table("a") == [0, 1, 2]
    h = hashes(A)
    assert bm.pool.cached == {h[0]: 0, h[1]: 1}
    assert bm.take_events() == [BlockStored((h[0], h[1]), None, tuple(A[:8]), BS)]
    bm.cache_full_blocks("a", h, 10, lambda a, b: A[a:b])  # nothing new: no event
    assert bm.take_events() == []


def test_a_hit_shares_the_blocks_and_counts_references():
    bm = manager()
    compute(bm, "a", A)
    b_tokens = A[:8] + [99, 98, 97]
    assert compute(bm, "b", b_tokens) == [0, 1]
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.pool.ref_counts[:4] == [2, 2, 1, 1]
    bm.free("a")
    assert bm.pool.ref_counts[:4] == [1, 1, 0, 1]
    assert bm.pool.num_evictable_blocks == 0  # block 2 has no hash, 0 and 1 are held
    bm.free("b")
    assert bm.pool.num_evictable_blocks == 2 and bm.num_free_blocks == 8
    assert all(c == 0 for c in bm.pool.ref_counts)
    bm.check_invariants()


def test_miss_partial_hit_and_the_last_token_is_always_computed():
    bm = manager()
    compute(bm, "a", A)
    bm.free("a")
    assert bm.find_cached_blocks(hashes([11] + A[1:]), 2) == []  # first token differs
    assert bm.find_cached_blocks(hashes(A[:4] + [0, 0, 0, 0, 0]), 2) == [0]  # block 0 only
    assert bm.find_cached_blocks(hashes(A[:8]), (8 - 1) // BS) == [0]  # prompt of 8: one block
    assert bm.find_cached_blocks(hashes(A[:8], salt="x"), 1) == []  # another salt: no reuse


def test_freed_blocks_are_evicted_least_recently_freed_first_tail_first():
    bm = manager()
    compute(bm, "a", A)  # blocks 0 1 2
    bm.take_events()
    bm.free("a")  # released tail first: the free queue is 3 4 5 6 7 2 1 0
    assert bm.allocate("c", 6 * BS) == [3, 4, 5, 6, 7, 2]
    assert bm.pool.num_cached_blocks == 2 and bm.take_events() == []
    h = hashes(A)
    assert bm.allocate("c", 7 * BS) == [1]  # evicts block 1 (A's second block) first
    assert bm.take_events() == [BlockRemoved((h[1],))]
    assert bm.find_cached_blocks(h, 2) == [0]  # the first block still hits
    assert bm.allocate("c", 8 * BS) == [0]
    assert bm.take_events() == [BlockRemoved((h[0],))]
    assert bm.pool.cached == {}
    bm.check_invariants()


def test_a_hit_on_a_free_block_takes_it_off_the_free_queue_and_is_all_or_nothing():
    bm = manager(num_blocks=4)
    compute(bm, "a", A)  # 0 1 2
    bm.free("a")  # free queue 3 2 1 0; blocks 0 and 1 evictable
    hits = bm.find_cached_blocks(hashes(A), 2)
    assert hits == [0, 1]
    assert bm.allocate("b", 5 * BS, hits) is None  # 2 hits + 3 new > 4 free
    assert bm.block_table("b") == [] and bm.pool.num_evictable_blocks == 2
    assert bm.allocate("b", 4 * BS, hits) == [3, 2]
    assert bm.block_table("b") == [0, 1, 3, 2]
    assert bm.pool.num_evictable_blocks == 0 and bm.num_free_blocks == 0
    bm.check_invariants()


def test_the_same_block_computed_twice_is_cached_once():
    bm = manager()
    assert bm.allocate("a", 8) == [0, 1] and bm.allocate("b", 8) == [2, 3]
    h = hashes(A[:8])
    bm.cache_full_blocks("a", h, 8, lambda a, b: A[a:b])
    bm.cache_full_blocks("b", h, 8, lambda a, b: A[a:b])
    assert bm.pool.cached == {h[0]: 0, h[1]: 1}
    assert len(bm.take_events()) == 1
    bm.free("b")
    assert bm.pool.num_evictable_blocks == 0  # b's copies carry no hash
    bm.check_invariants()


def test_reset_needs_an_idle_pool_and_emits_all_blocks_cleared():
    bm = manager()
    compute(bm, "a", A)
    bm.take_events()
    assert bm.reset_prefix_cache() is False
    assert bm.pool.num_cached_blocks == 2 and bm.take_events() == []
    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.pool.cached == {} and bm.pool.num_evictable_blocks == 0
    assert bm.take_events() == [AllBlocksCleared()]
    assert bm.find_cached_blocks(hashes(A), 2) == []
    bm.check_invariants()


def test_without_prefix_caching_nothing_is_cached():
    bm = BlockManager(8, BS)
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", hashes(A), 10, lambda a, b: A[a:b])
    assert bm.pool.cached == {} and bm.find_cached_blocks(hashes(A), 2) == []


def test_invariants_catch_a_block_both_free_and_cached_wrongly():
    bm = manager()
    compute(bm, "a", A)
    bm.pool.block_hashes[2] = 12345  # a hash the map does not know
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---- the scheduler ----------------------------------------------------------------------

def scheduler(num_blocks: int = 16, **config) -> tuple[Scheduler, BlockManager]:
    bm = manager(num_blocks)
    return Scheduler(SchedulerConfig(**config), bm), bm


def request(rid: str, prompt: list[int], max_tokens: int = 2, salt: str | None = None,
            arrival_s: float = 0.0) -> Sequence:
    return Sequence(rid, tuple(prompt), SamplingParams.greedy_params(max_tokens), 0,
                    arrival_s, next(_order), cache_salt=salt)


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, {e.request_id: 1 for e in out.scheduled if e.samples})
    sched.check_invariants()
    return out


def run_all(sched: Scheduler) -> list:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
    return outs


def entries(out) -> list[tuple]:
    return [(e.request_id, e.num_computed_tokens, e.num_new_tokens, e.block_ids)
            for e in out.scheduled]


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def test_a_second_request_skips_its_cached_prefix():
    sched, bm = scheduler()
    sched.add(request("a", PROMPT))
    assert entries(step(sched)) == [("a", 0, 18, (0, 1, 2, 3, 4))]
    run_all(sched)
    sched.add(request("b", PROMPT[:16] + [7, 7, 7]))
    out = step(sched)
    assert entries(out) == [("b", 16, 3, (0, 1, 2, 3, 5))]
    assert out.num_prefill_tokens == 3
    seq_b = sched.get("b")
    assert seq_b.num_cached_tokens == 16
    assert (sched.num_prefix_query_tokens, sched.num_prefix_hit_tokens) == (18 + 19, 16)
    run_all(sched)
    assert all(c == 0 for c in bm.pool.ref_counts)


def test_a_fully_cached_prompt_recomputes_its_last_block():
    sched, bm = scheduler()
    sched.add(request("a", PROMPT[:16]))
    run_all(sched)
    sched.add(request("b", PROMPT[:16]))
    out = step(sched)
    # 4 cached full blocks, but one token must be computed: the hit stops at block 3
    assert entries(out) == [("b", 12, 4, (0, 1, 2, 5))]
    assert out.scheduled[0].samples


def test_different_salts_do_not_share():
    sched, _ = scheduler()
    sched.add(request("a", PROMPT, salt="t1"))
    run_all(sched)
    sched.add(request("b", PROMPT, salt="t2"))
    assert entries(step(sched))[0][1] == 0
    run_all(sched)
    sched.add(request("c", PROMPT, salt="t1"))
    assert entries(step(sched))[0][1] == 16


def test_chunked_prefill_caches_each_chunk_and_a_later_request_hits_mid_prefill():
    sched, bm = scheduler(max_num_batched_tokens=8)
    sched.add(request("a", PROMPT, max_tokens=4))
    assert entries(step(sched)) == [("a", 0, 8, (0, 1))]
    assert bm.pool.num_cached_blocks == 2  # computed in that step: cached already
    sched.add(request("b", PROMPT[:8] + [5, 5, 5], arrival_s=1.0))
    out = step(sched)
    assert entries(out) == [("a", 8, 8, (0, 1, 2, 3))]  # the budget went to a
    out = step(sched)
    assert entries(out) == [("a", 16, 2, (0, 1, 2, 3, 4)), ("b", 8, 3, (0, 1, 5))]
    run_all(sched)
    assert all(c == 0 for c in bm.pool.ref_counts) and bm.num_free_blocks == 16


def test_abort_keeps_computed_blocks_reusable():
    sched, bm = scheduler(max_num_batched_tokens=8)
    sched.add(request("a", PROMPT))
    step(sched)  # blocks 0 1 computed and cached
    sched.abort("a")
    assert bm.num_free_blocks == 16 and bm.pool.num_evictable_blocks == 2
    sched.add(request("b", PROMPT))
    assert entries(step(sched)) == [("b", 8, 8, (0, 1, 2, 3))]
    sched.check_invariants()


def test_preempted_request_resumes_from_its_own_cached_blocks():
    # 8 blocks: a (prompt 12) and b (prompt 12) fill 6; decoding grows both until b is evicted
    sched, bm = scheduler(num_blocks=7, max_num_batched_tokens=32)
    sched.add(request("a", PROMPT[:12], max_tokens=10))
    sched.add(request("b", [50 + i for i in range(12)], max_tokens=10, arrival_s=1.0))
    outs = run_all(sched)
    assert sched.num_preemptions >= 1
    resumed = [e for out in outs for e in out.scheduled
               if e.request_id == "b" and e.num_computed_tokens > 0
               and e.num_new_tokens > 1]
    assert resumed, "b was recomputed from scratch instead of from its cached blocks"
    assert bm.num_free_blocks == 7 and all(c == 0 for c in bm.pool.ref_counts)
    # a recompute is not a prompt lookup: the counters saw each prompt once
    assert sched.num_prefix_query_tokens == 24
    bm.check_invariants()


def test_events_follow_the_steps_in_order():
    sched, bm = scheduler(num_blocks=6, max_num_batched_tokens=8)
    sched.add(request("a", PROMPT[:10], max_tokens=1))
    step(sched)
    h = hashes(PROMPT[:10])
    assert bm.take_events() == [BlockStored((h[0], h[1]), None, tuple(PROMPT[:8]), BS)]
    run_all(sched)
    assert bm.take_events() == []  # the last two tokens fill no block
    other = [200 + i for i in range(22)]
    sched.add(request("b", other, max_tokens=1))
    run_all(sched)
    events = bm.take_events()
    ho = hashes(other)
    # b needs 6 blocks: the free queue 3 4 5 2 1 0 evicts a's blocks 1 then 0, tail first
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((h[1],)), BlockRemoved((h[0],))]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [hh for e in stored for hh in e.block_hashes] == ho[:5]
    assert stored[0].parent_block_hash is None
    # chunks of 8 tokens: blocks 3 4 (stored), then 5 and 2 (stored), then 1 and 0 evicted
    kinds = [(type(e).__name__, len(e.block_hashes)) for e in events]
    assert kinds == [("BlockStored", 2), ("BlockStored", 2), ("BlockRemoved", 1),
                     ("BlockRemoved", 1), ("BlockStored", 1)]
