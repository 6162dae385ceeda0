"""Bad requests and bad configuration raise clear ValueErrors and leave the engine unchanged."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine.from_preset("tiny", device="cpu", num_blocks=8, block_size=4,
                                max_model_len=64, check_invariants=True)
    eng.add_request("existing", [1, 2, 3], SamplingParams.greedy_params(4))
    eng.step()
    return eng


def snapshot(engine: LLMEngine) -> dict:
    state = engine.state()
    del state["now_s"]
    return state


GREEDY = SamplingParams.greedy_params(4)

BAD_REQUESTS = {
    "empty prompt": ("r", [], GREEDY, "empty"),
    "prompt fills the context": ("r", [1] * 64, GREEDY, "max_model_len"),
    "prompt longer than the context": ("r", [1] * 100, GREEDY, "max_model_len"),
    "prompt + max_tokens over the context": ("r", [1] * 60, SamplingParams(max_tokens=5),
                                             "exceeds max_model_len"),
    "token id past the vocabulary": ("r", [1, 49152], GREEDY, "ints in"),
    "negative token id": ("r", [-1], GREEDY, "ints in"),
    "non-integer token": ("r", [1.5], GREEDY, "ints in"),
    "duplicate request id": ("existing", [1], GREEDY, "already"),
    "empty request id": ("", [1], GREEDY, "request_id"),
    "params of the wrong type": ("r", [1], {"max_tokens": 3}, "SamplingParams"),
    "more blocks than the pool": ("r", [1] * 30, SamplingParams(max_tokens=30), "KV blocks"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_raises_and_changes_nothing(engine, case):
    request_id, prompt, params, message = BAD_REQUESTS[case]
    before = snapshot(engine)
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, prompt, params)
    assert snapshot(engine) == before
    engine.check_invariants()


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.1}, {"top_p": 0.0},
    {"top_p": 1.5}, {"top_k": 0}, {"stop": ("",)},
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_unknown_preset_and_option():
    with pytest.raises(ValueError, match="unknown model preset"):
        LLMEngine.from_preset("gpt-5")
    with pytest.raises(ValueError, match="unknown engine option"):
        LLMEngine.from_preset("tiny", device="cpu", num_blokcs=4)


@pytest.mark.parametrize("build", [
    lambda: CacheConfig(block_size=0),
    lambda: CacheConfig(num_blocks=0),
    lambda: CacheConfig(kv_cache_bytes=0),
    lambda: SchedulerConfig(max_num_seqs=0),
    lambda: SchedulerConfig(max_num_batched_tokens=0),
    lambda: SchedulerConfig(policy="lifo"),
    lambda: EngineConfig.from_preset("tiny", dtype="int8"),
    lambda: EngineConfig.from_preset("tiny", num_heads=3),
    lambda: EngineConfig.from_preset("tiny", enable_chunked_prefill=False,
                                     max_num_batched_tokens=16),
])
def test_bad_config(build):
    with pytest.raises(ValueError):
        build()


def test_abort_of_unknown_or_finished_request_is_false(engine):
    assert engine.abort_request("no-such-request") is False
    eng = LLMEngine.from_preset("tiny", device="cpu", num_blocks=8)
    eng.add_request("a", [5], SamplingParams.greedy_params(1))
    eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.abort_request("a") is False


def test_request_id_is_reusable_after_finishing():
    eng = LLMEngine.from_preset("tiny", device="cpu", num_blocks=8)
    for _ in range(2):
        eng.add_request("same", [5, 6], SamplingParams.greedy_params(1))
        assert eng.step().outputs[0].finished


def test_pool_size_from_count_or_memory_budget():
    # tiny, fp32: K+V x 2 layers x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token
    per_block = 16 * 512
    assert EngineConfig.from_preset("tiny", device="cpu", num_blocks=7).num_kv_blocks() == 7
    config = EngineConfig.from_preset("tiny", device="cpu", kv_cache_bytes=10 * per_block + 5)
    assert config.num_kv_blocks() == 10
    small = EngineConfig.from_preset("tiny", device="cpu", max_num_seqs=2)
    assert small.num_kv_blocks() == 2 * (1024 // 16)  # default: max_num_seqs full sequences
    with pytest.raises(ValueError, match="holds no"):
        EngineConfig.from_preset("tiny", device="cpu", kv_cache_bytes=100).num_kv_blocks()
