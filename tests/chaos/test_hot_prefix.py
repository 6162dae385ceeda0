"""The cache-loss probe asks real replicas (sim engines, prefix cache on) who holds the hottest
prefix: the one that served it says so in ``cached_tokens``."""

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from chaos.hot_prefix import hot_replica_probe
from chaos.records import RequestSpec
from chaos.schedule import prompt_token_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE_ARGS = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
               "--time-scale", "1", "--max-num-seqs", "8"]


def test_the_replica_that_served_the_hottest_prefix_is_named():
    spec = RequestSpec(0, 0.0, 330, 1, "interactive", "t",
                       prompt_parts=(("prefix-0", 320), ("question-7", 10)))
    with start_engine(ENGINE_ARGS) as a, start_engine(ENGINE_ARGS) as b:
        response = httpx.post(b.base_url + "/v1/completions", trust_env=False, timeout=30.0,
                              json={"prompt": prompt_token_ids(5, spec), "max_tokens": 1})
        assert response.status_code == 200
        probe = hot_replica_probe(lambda: [a.base_url, b.base_url], seed=5, prefix_tokens=320)
        assert asyncio.run(probe()) == 1
