"""Saturation throughput of the simulated backend on ShareGPT-like traffic.

All requests are queued at t = 0 (an offline / infinite-rate run, as throughput benchmarks do)
and the sim engine serves them on a ``VirtualClock``: each step advances virtual time by exactly
the timing model's prediction, so the result is the model's throughput, computed in seconds of
CPU time instead of minutes of wall time. Traffic: prompt and output lengths drawn from
log-normal distributions with means ≈ 230 and ≈ 200 tokens (clipped to [4, 1024] and
[1, 1024]), the shape of the ShareGPT conversations serving benchmarks replay.

    python -m chaos.bench.sim --model llama-3.1-8b --gpu a100-80g --num-requests 1000
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass

from engine.sampling_params import SamplingParams
from engine.sim_runner import VirtualClock, build_sim_engine

__all__ = ["BenchResult", "sharegpt_like_lengths", "run_saturation", "configure", "run"]


@dataclass(frozen=True)
class BenchResult:
    model: str
    gpu: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_steps: int
    elapsed_s: float  # virtual (model) seconds
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    mean_decode_batch: float
    num_preemptions: int


def sharegpt_like_lengths(num_requests: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) pairs: log-normal, means ≈ 230 / ≈ 200 tokens."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, low: int) -> int:
        return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), low), 1024))

    return [(draw(170, 0.8, 4), draw(150, 0.75, 1)) for _ in range(num_requests)]


def run_saturation(model: str = "llama-3.1-8b", gpu: str = "a100-80g", num_requests: int = 1000,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                   seed: int = 0) -> BenchResult:
    clock = VirtualClock()
    engine = build_sim_engine(model, gpu, time_scale=1.0, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                              clock=clock, sleep=clock.sleep, spin_s=0.0)
    lengths = sharegpt_like_lengths(num_requests, seed)
    for i, (prompt, output) in enumerate(lengths):
        tokens = [(i * 7919 + j * 104729) % 30000 + 256 for j in range(prompt)]
        engine.add_request(f"req-{i}", tokens, SamplingParams(max_tokens=output), arrival_s=0.0)
    num_steps = decode_seqs = 0
    while engine.has_unfinished_requests():
        record = engine.step().iteration
        if record is not None:
            num_steps += 1
            decode_seqs += record.num_decode_seqs
    elapsed = clock()
    prompt_total = sum(p for p, _ in lengths)
    output_total = sum(o for _, o in lengths)
    return BenchResult(model=model, gpu=gpu, num_requests=num_requests,
                       num_prompt_tokens=prompt_total, num_output_tokens=output_total,
                       num_steps=num_steps, elapsed_s=elapsed,
                       output_tokens_per_s=output_total / elapsed,
                       total_tokens_per_s=(prompt_total + output_total) / elapsed,
                       requests_per_s=num_requests / elapsed,
                       mean_decode_batch=decode_seqs / max(num_steps, 1),
                       num_preemptions=engine.num_preemptions)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="model preset the timing model uses")
    parser.add_argument("--gpu", default="a100-80g",
                        help="GPU profile the timing model uses")
    parser.add_argument("--num-requests", type=int, default=1000,
                        help="requests in the simulated run")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="the simulated engine's sequence slots")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the simulated engine's tokens per step")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    result = run_saturation(args.model, args.gpu, args.num_requests, args.max_num_seqs,
                            args.max_num_batched_tokens, args.seed)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    print(f"sim saturation: {result.model} on {result.gpu}, {result.num_requests} requests "
          f"(mean prompt {result.num_prompt_tokens / result.num_requests:.0f}, "
          f"mean output {result.num_output_tokens / result.num_requests:.0f} tokens)")
    print(f"  model time      {result.elapsed_s:9.2f} s over {result.num_steps} steps "
          f"(mean decode batch {result.mean_decode_batch:.0f}, "
          f"{result.num_preemptions} preemptions)")
    print(f"  output tokens/s {result.output_tokens_per_s:9.0f}")
    print(f"  total tokens/s  {result.total_tokens_per_s:9.0f}")
    print(f"  requests/s      {result.requests_per_s:9.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.bench.sim", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
