"""``kvguard generate``: stream one completion from the built-in engine to stdout.

    kvguard generate --model smollm2-135m --chat "What is the capital of France?"

Text is printed as tokens arrive (an ``IncrementalDetokenizer`` holds back partial UTF-8
characters). ``--stats`` adds one line on stderr with token counts and timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

__all__ = ["configure", "run", "stream_completion"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="model preset with real weights and a tokenizer (default: %(default)s)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template as a user message")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--stats", action="store_true", help="print timings to stderr at the end")


def run(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    overrides = {"max_num_seqs": 1} if args.device is None else {"max_num_seqs": 1,
                                                                 "device": args.device}
    engine = LLMEngine.from_preset(args.model, **overrides)
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer (random weights); "
                         "use a real model such as smollm2-135m")
    prompt_ids = _prompt_ids(engine.tokenizer, args.prompt, args.chat, args.system)
    stats = stream_completion(engine, prompt_ids, params, sys.stdout)
    if args.stats:
        print(_format_stats(stats), file=sys.stderr)
    return 0


def _prompt_ids(tokenizer, prompt: str, chat: bool, system: str | None) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt, add_special_tokens=True)
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def stream_completion(engine, prompt_ids: list[int], params, out: TextIO,
                      request_id: str = "generate-0") -> dict:
    """Run one request to completion, writing text deltas to ``out``; returns its token ids,
    finish reason and timings."""
    from engine.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=True)
    start_s = time.perf_counter()
    first_token_s = None
    finish_reason, output_ids = None, []
    engine.add_request(request_id, prompt_ids, params)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.new_token_ids and first_token_s is None:
                first_token_s = time.perf_counter()
            output_ids.extend(output.new_token_ids)
            _write(out, detok.add_many(output.new_token_ids))
            if output.finished:
                finish_reason = output.finish_reason
    _write(out, detok.flush() + "\n")
    end_s = time.perf_counter()
    return {"num_prompt_tokens": len(prompt_ids), "num_output_tokens": len(output_ids),
            "output_token_ids": output_ids,
            "finish_reason": finish_reason, "total_s": end_s - start_s,
            "ttft_s": (first_token_s or end_s) - start_s}


def _write(out: TextIO, text: str) -> None:
    if text:
        out.write(text)
        out.flush()


def _format_stats(stats: dict) -> str:
    decode_s = stats["total_s"] - stats["ttft_s"]
    rate = (stats["num_output_tokens"] - 1) / decode_s if decode_s > 0 else float("nan")
    return (f"[{stats['num_prompt_tokens']} prompt tokens, {stats['num_output_tokens']} output "
            f"tokens, finish={stats['finish_reason']}, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
            f"decode {rate:.1f} tok/s]")
