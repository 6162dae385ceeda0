"""``kvguard bench pricing``: CPU time to price one request (``Pricer.price``), in-process.

Pricing runs on every admitted path's request before the policy sees it: the body is parsed,
its tokens and blocks counted, the retry and idempotency headers read. This bench prices the
same chat completion (``--chars`` characters of user content, ``max_tokens`` 64, a retry
counter and an ``Idempotency-Key``) ``--requests`` times and prints the median and mean per
request over ``--rounds`` rounds. Results and their commands go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from guard.config import GuardConfig
from guard.request.pricing import Pricer

__all__ = ["configure", "price_us_per_request", "run"]

CHAT_PATH = "/v1/chat/completions"


def chat_body(num_chars: int) -> bytes:
    """A streamed chat completion whose one user message holds ``num_chars`` characters."""
    content = ("hello " * (num_chars // 6 + 1))[:num_chars]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 64, "stream": True}).encode()


def price_us_per_request(num_requests: int, num_chars: int) -> float:
    """Mean wall µs per ``Pricer.price`` call over ``num_requests`` calls on one pricer."""
    config = GuardConfig()
    pricer, tenant, body = Pricer(config), config.anonymous_tenant, chat_body(num_chars)
    headers = {"x-stainless-retry-count": "0", "idempotency-key": "k"}
    start_s = time.perf_counter()
    for i in range(num_requests):
        pricer.price(body, CHAT_PATH, headers, tenant, float(i), max_model_len=4096,
                     block_size=16, request_id="r")
    return (time.perf_counter() - start_s) / num_requests * 1e6


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="requests priced per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds (the best round is reported)")
    parser.add_argument("--chars", type=int, default=300, help="characters of user content")


def run(args: argparse.Namespace) -> int:
    for key in ("requests", "rounds", "chars"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key} must be at least 1, got {getattr(args, key)}")
    rounds_us = [price_us_per_request(args.requests, args.chars) for _ in range(args.rounds)]
    print(f"price(): a chat request of {args.chars} characters, {args.requests} requests x "
          f"{args.rounds} rounds: median {statistics.median(rounds_us):.1f} us per request "
          f"(rounds {min(rounds_us):.1f}-{max(rounds_us):.1f} us)")
    return 0
