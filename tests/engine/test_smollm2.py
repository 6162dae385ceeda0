"""The real SmolLM2-135M-Instruct weights through the paged engine answer a chat question."""

from __future__ import annotations

import pytest

from engine.gguf_loader import ModelFileNotFoundError, find_smollm2_gguf
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    try:
        find_smollm2_gguf()
    except ModelFileNotFoundError as exc:
        pytest.skip(str(exc))
    return LLMEngine.from_preset("smollm2-135m", device="cpu", max_num_seqs=4, num_blocks=64)


def run_greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    detoks = {rid: IncrementalDetokenizer(engine.tokenizer) for rid in prompts}
    finish = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams.greedy_params(max_tokens))
    for _ in range(10 * max_tokens):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            detoks[out.request_id].add_many(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return {rid: (d.text + d.flush(), finish.get(rid)) for rid, d in detoks.items()}


def chat_ids(engine: LLMEngine, question: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))


def test_engine_uses_the_gguf_config_and_tokenizer(engine):
    model = engine.config.model
    assert (model.num_layers, model.hidden_size, model.num_kv_heads) == (30, 576, 3)
    assert model.eos_token_ids == (2,) and engine.tokenizer.eos_token_id == 2


def test_greedy_chat_says_paris_and_stops_at_im_end(engine):
    results = run_greedy(engine, {
        "france": chat_ids(engine, "What is the capital of France?"),
        "other": chat_ids(engine, "Name a primary color."),  # batched alongside
    }, max_tokens=16)
    text, reason = results["france"]
    assert "Paris" in text
    assert reason == "stop"
    assert engine.num_free_blocks == engine.num_total_blocks
