"""``kvguard bench engine --prefix``: time to first token with a cached prompt prefix vs none.

On the torch engine (SmolLM2-135M on the CPU by default), each repeat sends two requests one
after the other, each ``--prompt-tokens`` long and sharing their first ``--prefix-tokens``
(seeded random token ids): the first finds nothing cached (the prefix cache is reset before
it), the second finds the shared prefix's full blocks cached and prefills only the rest. Time
to first token is measured in-process, from ``add_request`` to the step that returns the first
token (no HTTP). Reported: the median of each, their ratio, and the tokens each prefilled.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

__all__ = ["PrefixRun", "configure", "run", "run_pair"]


@dataclass(frozen=True)
class PrefixRun:
    """One request: its time to first token and what the prefix cache gave it."""

    ttft_s: float
    num_cached_tokens: int
    num_prefill_tokens: int


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", action="store_true", required=True,
                        help="run this benchmark (the prefix cache's TTFT), not the throughput one")
    parser.add_argument("--model", default="smollm2-135m",
                        help="engine preset (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="default: %(default)s")
    parser.add_argument("--prefix-tokens", type=int, default=1400,
                        help="tokens the two prompts share (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")


def _validate(args: argparse.Namespace) -> None:
    if args.prompt_tokens < 2:
        raise ValueError(f"--prompt-tokens must be >= 2, got {args.prompt_tokens}")
    if not 0 < args.prefix_tokens < args.prompt_tokens:
        raise ValueError(f"--prefix-tokens must be in [1, --prompt-tokens), got "
                         f"{args.prefix_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")


def _first_token(engine, request_id: str, prompt: list[int]) -> PrefixRun:
    from engine.sampling_params import SamplingParams

    start_s = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams.greedy_params(1))
    num_prefill = 0
    while True:
        result = engine.step()
        if result.iteration is not None:
            num_prefill += result.iteration.num_prefill_tokens
        done = [o for o in result.outputs if o.request_id == request_id and o.new_token_ids]
        if done:
            return PrefixRun(time.perf_counter() - start_s, done[0].num_cached_tokens,
                             num_prefill)


def run_pair(engine, prefix: list[int], suffixes: tuple[list[int], list[int]],
             tag: str) -> tuple[PrefixRun, PrefixRun]:
    """The uncached request, then the one that shares its prefix (cache reset first)."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine still holds blocks: cannot reset its prefix cache")
    cold = _first_token(engine, f"{tag}-cold", prefix + suffixes[0])
    warm = _first_token(engine, f"{tag}-warm", prefix + suffixes[1])
    return cold, warm


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.llm_engine import LLMEngine

    _validate(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    block_size = 16
    num_blocks = 2 * (-(-args.prompt_tokens // block_size)) + 4
    engine = LLMEngine.from_preset(args.model, device=args.device, num_blocks=num_blocks,
                                   max_num_batched_tokens=max(2048, args.prompt_tokens),
                                   block_size=block_size)
    rng = random.Random(args.seed)
    low = 1 + max(engine.tokenizer.special_token_ids if engine.tokenizer else (0,), default=0)
    draw = lambda n: [rng.randrange(low, engine.config.model.vocab_size)  # noqa: E731
                      for _ in range(n)]
    print(f"kvguard bench engine --prefix: model {args.model}, device {args.device}, dtype "
          f"{engine.config.resolved_dtype()}, torch threads {torch.get_num_threads()}; prompts "
          f"of {args.prompt_tokens} tokens sharing {args.prefix_tokens}; {args.repeats} "
          "repeats", flush=True)
    _first_token(engine, "warmup", draw(32))
    colds, warms = [], []
    suffix_tokens = args.prompt_tokens - args.prefix_tokens
    for i in range(args.repeats):
        cold, warm = run_pair(engine, draw(args.prefix_tokens),
                              (draw(suffix_tokens), draw(suffix_tokens)), f"r{i}")
        colds.append(cold)
        warms.append(warm)
        print(f"  repeat {i}: uncached {cold.ttft_s * 1e3:.1f} ms, cached "
              f"{warm.ttft_s * 1e3:.1f} ms ({warm.num_cached_tokens} tokens cached, "
              f"{warm.num_prefill_tokens} prefilled)", flush=True)
    cold_s = statistics.median(r.ttft_s for r in colds)
    warm_s = statistics.median(r.ttft_s for r in warms)
    print("| prompt tokens | cached tokens | uncached TTFT ms (median) | cached TTFT ms (median) "
          "| ratio |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {args.prompt_tokens} | {warms[0].num_cached_tokens} | {cold_s * 1e3:.1f} | "
          f"{warm_s * 1e3:.1f} | {cold_s / warm_s:.1f}x |")
    return 0
