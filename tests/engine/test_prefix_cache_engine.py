"""The prefix cache inside the real engine: greedy outputs identical with the cache on and off
(tiny preset, and SmolLM2-135M), also when a small pool forces preemption and eviction; every
block ends free with no reference; a repeated 600-token prefix is served from the cache."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_events import BlockRemoved
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def workload(num_requests: int = 32, seed: int = 0, system_tokens: tuple[int, int] = (40, 70),
             suffix_tokens: tuple[int, int] = (1, 20)) -> list[tuple[str, list[int], int]]:
    """Requests over 4 shared "system prompts", each with its own suffix."""
    rng = random.Random(seed)
    systems = [[rng.randrange(300, 40000) for _ in range(rng.randrange(*system_tokens))]
               for _ in range(4)]
    out = []
    for i in range(num_requests):
        suffix = [rng.randrange(300, 40000) for _ in range(rng.randrange(*suffix_tokens))]
        out.append((f"r{i:02d}", systems[i % 4] + suffix, rng.randrange(2, 6)))
    return out


def run(engine: LLMEngine, requests, per_step: int = 1) -> dict[str, list[int]]:
    """Add ``per_step`` requests before each step (so later ones find earlier ones cached)."""
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    pending = list(requests)
    for _ in range(5000):
        for rid, prompt, max_tokens in pending[:per_step]:
            engine.add_request(rid, prompt, SamplingParams.greedy_params(max_tokens,
                                                                         ignore_eos=True))
        pending = pending[per_step:]
        if not pending and not engine.has_unfinished_requests():
            return tokens
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def assert_all_unreferenced(engine: LLMEngine) -> None:
    """Every block is free (possibly cached, then evictable) and no count is left."""
    pool = engine.block_manager.pool
    assert engine.num_free_blocks == engine.num_total_blocks
    assert all(count == 0 for count in pool.ref_counts)
    assert pool.num_evictable_blocks == pool.num_cached_blocks
    assert not engine.block_manager.holders()
    engine.check_invariants()


def compare(make_engine, requests, small_pool_blocks: int, per_step: int = 1) -> None:
    for num_blocks in (None, small_pool_blocks):
        pool = {} if num_blocks is None else {"num_blocks": num_blocks}
        off = make_engine(enable_prefix_caching=False, **pool)
        on = make_engine(enable_prefix_caching=True, **pool)
        events: list = []
        on.attach_kv_event_sink(events.extend)
        assert run(on, requests, per_step) == run(off, requests, per_step)
        state = on.state()
        min_hit_ratio = 0.5 if num_blocks is None else 0.1  # the small pool evicts a lot
        assert state["prefix_cache_hits"] > min_hit_ratio * state["prefix_cache_queries"]
        if num_blocks is not None:  # the small pool evicted and preempted with the cache on
            assert on.num_preemptions > 0
            assert any(isinstance(e, BlockRemoved) for e in events)
        for engine in (on, off):
            assert_all_unreferenced(engine)


def test_tiny_greedy_outputs_identical_with_the_cache_on_and_off():
    def make(**overrides) -> LLMEngine:
        return LLMEngine.from_preset("tiny", device="cpu", dtype="float32", check_invariants=True,
                                     max_num_seqs=8, max_num_batched_tokens=64, **overrides)

    compare(make, workload(), small_pool_blocks=14)


# ---- SmolLM2-135M --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> LLMEngine:
    from engine.gguf_loader import ModelFileNotFoundError, find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except ModelFileNotFoundError as exc:
        pytest.skip(str(exc))
    return LLMEngine.from_preset("smollm2-135m", device="cpu", num_blocks=8)


def smollm2_engine(base: LLMEngine, **overrides) -> LLMEngine:
    """Another engine on the loaded weights (its own KV pool and options)."""
    options = dict(device="cpu", dtype="float32", check_invariants=True) | overrides
    config = EngineConfig.from_model(base.config.model, **options)
    runner = ModelRunner(base.runner.model, config.num_kv_blocks(), config.cache.block_size)
    return LLMEngine(config, runner=runner, tokenizer=base.tokenizer)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_greedy_outputs_identical_with_the_cache_on_and_off(smollm2):
    def make(**overrides) -> LLMEngine:
        options = dict(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=256) | overrides
        return smollm2_engine(smollm2, **options)

    # short prompts and outputs keep the 4 runs of 32 requests to a modest CPU time
    compare(make, workload(system_tokens=(20, 40), suffix_tokens=(1, 10)), small_pool_blocks=10,
            per_step=4)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_second_request_with_a_600_token_prefix_is_served_from_the_cache(smollm2):
    engine = smollm2_engine(smollm2, num_blocks=128, check_invariants=False)
    rng = random.Random(7)
    prefix = [rng.randrange(300, 40000) for _ in range(600)]
    timings, cached, prefill = [], [], []
    for rid in ("first", "second"):
        prompt = prefix + [rng.randrange(300, 40000) for _ in range(10)]
        start_s = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams.greedy_params(1))
        computed = 0
        while True:
            result = engine.step()
            computed += result.iteration.num_prefill_tokens
            if result.outputs:
                break
        timings.append(time.perf_counter() - start_s)
        cached.append(result.outputs[0].num_cached_tokens)
        prefill.append(computed)
    full_prefix_blocks_tokens = 600 // 16 * 16
    assert cached[0] == 0 and cached[1] >= 0.9 * full_prefix_blocks_tokens
    assert prefill == [610, 610 - cached[1]]
    assert timings[1] <= 0.5 * timings[0], timings
    assert_all_unreferenced(engine)


def test_reset_prefix_cache_needs_an_idle_engine_and_tells_the_sink():
    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=16, check_invariants=True)
    events: list = []
    engine.attach_kv_event_sink(events.extend)
    prompt = list(range(300, 340))
    engine.add_request("a", prompt, SamplingParams.greedy_params(4, ignore_eos=True))
    engine.step()
    assert engine.state()["num_cached_blocks"] == 2
    assert engine.reset_prefix_cache() is False  # "a" still holds its blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert type(events[-1]).__name__ == "AllBlocksCleared"
    state = engine.state()
    assert state["num_cached_blocks"] == 0 and state["num_evictable_blocks"] == 0
    engine.add_request("b", prompt, SamplingParams.greedy_params(1))
    out = [o for _ in range(5) for o in engine.step().outputs]
    assert out[0].num_cached_tokens == 0  # nothing left to hit


def test_a_waiting_request_reports_only_its_uncached_prompt_as_prefill_left():
    """The state of a request still waiting to be scheduled: the prefill it will do, its
    cached prefix left out (the guard forecasts and paces by it)."""
    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=32, check_invariants=True)
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks of 16, then 8
    engine.add_request("a", prompt, SamplingParams.greedy_params(1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("warm", [*prompt[:32], 7, 8, 9], SamplingParams.greedy_params(1))
    engine.add_request("cold", list(range(500, 535)), SamplingParams.greedy_params(1))
    waiting = {s["request_id"]: s for s in engine.state()["waiting"]}
    assert waiting["warm"]["num_prefill_tokens_remaining"] == 35 - 32
    assert waiting["cold"]["num_prefill_tokens_remaining"] == 35
    out = [o for _ in range(5) for o in engine.step().outputs]
    assert {o.request_id: o.num_cached_tokens for o in out}["warm"] == 32
