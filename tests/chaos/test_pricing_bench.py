"""``kvguard bench pricing``: it prices real requests and reports a per-request time."""

import argparse
import re

import pytest

from chaos.bench import pricing
from chaos.bench.cli import TARGETS
from guard.config import GuardConfig
from guard.request.pricing import Pricer


def args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pricing.configure(parser)
    return parser.parse_args([f"--{k}={v}" for k, v in overrides.items()])


def test_the_bench_is_a_kvguard_bench_target():
    assert TARGETS["pricing"][0] == "chaos.bench.pricing"


def test_its_body_is_a_chat_request_of_the_asked_size():
    config = GuardConfig()
    cost = Pricer(config).price(pricing.chat_body(600), pricing.CHAT_PATH, {},
                                config.anonymous_tenant, 0.0, max_model_len=4096, block_size=16)
    assert cost.max_tokens == 64 and cost.num_prompt_tokens > 600 // 8


def test_it_prints_the_median_per_request(capsys):
    assert pricing.run(args(requests=20, rounds=2, chars=50)) == 0
    out = capsys.readouterr().out
    assert re.search(r"50 characters, 20 requests x 2 rounds: median \d+\.\d us per request", out)


@pytest.mark.parametrize("key", ["requests", "rounds", "chars"])
def test_a_count_below_one_is_refused_by_name(key):
    with pytest.raises(ValueError, match=f"--{key} must be at least 1"):
        pricing.run(args(**{key: 0}))
