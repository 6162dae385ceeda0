"""The precise prefix-cache view end to end: ``kvguard engine --backend sim`` publishing its
KV-cache events over ZMQ (``--kv-events-endpoint``, advertised in its state), the guard
mounted with ``prefix_cache = "precise"`` subscribing to them. After the engine stored a
prompt's blocks, the guard predicts the hit of the same prompt sent again, and its predicted
hit ratio matches the engine's measured one."""

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

from tests.support.tokenizer_file import word_level_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE_ARGS = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
               "--time-scale", "1", "--max-num-seqs", "8",
               "--kv-events-endpoint", "tcp://127.0.0.1:*"]
PROMPT = list(range(3000, 3640))  # 640 tokens: 40 full blocks of 16




def _metric(client: httpx.Client, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/kvguard/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_the_guard_predicts_the_engines_hits_from_its_kv_events(tmp_path):
    config = tmp_path / "guard.toml"
    config.write_text(f'prefix_cache = "precise"\ntokenizer = "{word_level_tokenizer(tmp_path)}"\n'
                      'refresh_interval_s = 0.05\n')
    with start_engine([*ENGINE_ARGS, "--guard", str(config)]) as engine, \
            httpx.Client(base_url=engine.base_url, timeout=30.0, trust_env=False) as client:
        body = {"model": "llama-7b", "prompt": PROMPT, "max_tokens": 2}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200
        deadline = time.monotonic() + 20.0  # the events arrive after the engine's step
        while (_metric(client, "kvguard_prefix_cache_tracked_blocks") or 0) < 39:
            assert time.monotonic() < deadline, "no KV events reached the guard"
            time.sleep(0.05)
        second = client.post("/v1/completions", json=body)
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * 640
        predicted = _metric(client, "kvguard_prefix_cache_predicted_hit_ratio")
        # the guard expected the second request's whole cached prefix: (0 + 624) of 1,280
        assert predicted == pytest.approx(624 / 1280)
        assert abs(predicted - (0 + cached) / 1280) <= 0.05
