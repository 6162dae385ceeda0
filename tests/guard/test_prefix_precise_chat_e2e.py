"""Chat requests priced by the precise prefix-cache view: a real kvguard engine serving
SmolLM2-135M (its GGUF carries the chat template) with the guard mounted in precise mode and
the model's ``tokenizer.json`` and ``tokenizer_config.json`` as its ``tokenizer`` and
``chat_template``. A second chat with the same long system prompt is predicted cached, the
prediction matches the engine's measured ``cached_tokens`` within one block, and the guard
counts each chat prompt as the engine does."""

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.smollm2, pytest.mark.timeout(300)]

BLOCK_SIZE = 16
SYSTEM = ("You are a patient assistant for a hardware shop. " * 2 + " ".join(
    f"Rule {i}: answer politely, mention aisle {i % 7} when asked about item {i}."
    for i in range(24)))


def _model_files(tmp_path: Path) -> tuple[str, str]:
    """The engine's own tokenizer and template, written as the guard reads them."""
    from engine.tokenizer import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(tok.to_json())
    special = {name: None if token_id is None else tok.id_to_token(token_id)
               for name, token_id in (("bos_token", tok.bos_token_id),
                                      ("eos_token", tok.eos_token_id))}
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": tok.chat_template, **special}))
    return str(tokenizer), str(config)


def _metric(client: httpx.Client, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/kvguard/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def _chat(client: httpx.Client, question: str) -> dict:
    body = {"model": "smollm2-135m", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_second_chat_with_the_same_system_prompt_is_predicted_as_the_engine_caches_it(tmp_path):
    tokenizer, template = _model_files(tmp_path)
    config = tmp_path / "guard.toml"
    config.write_text(f'prefix_cache = "precise"\ntokenizer = "{tokenizer}"\n'
                      f'chat_template = "{template}"\nrefresh_interval_s = 0.05\n')
    args = ["--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32",
            "--max-num-seqs", "2", "--num-blocks", "128", "--block-size", str(BLOCK_SIZE),
            "--kv-events-endpoint", "tcp://127.0.0.1:*", "--guard", str(config)]
    with start_engine(args, timeout_s=180) as engine, \
            httpx.Client(base_url=engine.base_url, timeout=120.0, trust_env=False) as client:
        first = _chat(client, "Which aisle holds item 3?")
        num_first_blocks = first["usage"]["prompt_tokens"] // BLOCK_SIZE
        deadline = time.monotonic() + 60.0  # the events arrive after the engine's step
        while (_metric(client, "kvguard_prefix_cache_tracked_blocks") or 0) < num_first_blocks:
            assert time.monotonic() < deadline, "no KV events reached the guard"
            time.sleep(0.05)
        second = _chat(client, "Do you sell hammers?")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = _metric(client, "kvguard_prefix_cache_predicted_tokens_total")
        assert cached >= 20 * BLOCK_SIZE  # the system prompt's blocks were reused
        assert abs(predicted - cached) <= BLOCK_SIZE, (predicted, cached)
        assert _metric(client, "kvguard_prefix_cache_unrendered_chats_total") == 0
        # the guard counted both prompts exactly as the engine did: the same rendering
        routed = _metric(client, "kvguard_prefix_cache_routed_prompt_tokens_total")
        assert routed == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
