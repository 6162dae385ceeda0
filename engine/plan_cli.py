"""``kvguard plan``: the KV memory plan and decode roofline of a model on a GPU.

    kvguard plan --model llama-7b --gpu h100-80g --prompt-tokens 2048 --output-tokens 256
    kvguard plan ... --json        # one JSON object
    kvguard plan ... --measure     # on a CUDA machine: measured decode steps beside predictions
    kvguard plan ... --itl-ms 80   # the largest --max-num-batched-tokens that keeps gaps <= 80 ms
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from engine.config import PRESET_NAMES, model_preset
from engine.gpus import get_gpu, gpu_names
from engine.planner import (
    MemoryPlan,
    RooflineRow,
    ServingPlan,
    max_batched_tokens_for_itl,
    plan,
)
from engine.timing_model import TimingModel

__all__ = ["configure", "run", "plan_to_dict", "format_plan", "measure_decode_steps",
           "itl_budgets"]

_GIB, _MIB = 1 << 30, 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-7b", help=f"one of {', '.join(PRESET_NAMES)}")
    parser.add_argument("--gpu", default="h100-80g", help=f"one of {', '.join(gpu_names())}")
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="prompt tokens per sequence")
    parser.add_argument("--output-tokens", type=int, default=256,
                        help="output tokens per sequence")
    parser.add_argument("--prefix-hit-ratio", type=float, default=0.0,
                        help="expected share of each prompt served from the prefix cache "
                             "(0 <= h < 1): fewer new blocks per request, a shorter prefill")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory the engine may use")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="engine limit; sizes the sampler part of the activation estimate")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="engine limit; sizes the activation workspace and prefill chunks")
    parser.add_argument("--itl-ms", type=float, default=None,
                        help="an ITL SLO: recommend the largest --max-num-batched-tokens whose "
                             "step (decode batch + one prefill chunk) stays within it")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--measure", action="store_true",
                        help="CUDA only: time the torch engine's decode steps (random weights) "
                             "and print them beside the predictions")
    parser.add_argument("--measure-steps", type=int, default=8,
                        help="decode steps timed per batch size (median reported)")
    parser.add_argument("--measure-max-batch", type=int, default=64,
                        help="--measure: the largest decode batch timed")


def run(args: argparse.Namespace) -> int:
    model = model_preset(args.model)
    gpu = get_gpu(args.gpu)
    serving = plan(model, gpu, args.prompt_tokens, args.output_tokens,
                   args.gpu_memory_utilization, args.block_size,
                   args.max_num_batched_tokens, args.max_num_seqs,
                   prefix_hit_ratio=args.prefix_hit_ratio)
    if args.measure:
        return _run_measure(args, serving)
    budgets = itl_budgets(args, serving) if args.itl_ms is not None else None
    if args.json:
        out = plan_to_dict(serving)
        if budgets is not None:
            out["itl_s"] = args.itl_ms / 1e3
            out["max_num_batched_tokens_for_itl"] = budgets
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(serving))
        if budgets is not None:
            print("\n" + "\n".join(_itl_lines(args, budgets)))
    return 0


def itl_budgets(args: argparse.Namespace, serving: ServingPlan) -> list[dict]:
    """Per decode batch size of the roofline (up to ``--max-num-seqs``): the largest token
    budget within ``--itl-ms``."""
    if not args.itl_ms > 0:
        raise ValueError(f"--itl-ms must be > 0, got {args.itl_ms!r}")
    timing = TimingModel(model_preset(args.model), get_gpu(args.gpu))
    return [{"batch_size": r.batch_size,
             "max_num_batched_tokens": max_batched_tokens_for_itl(
                 timing, args.itl_ms / 1e3, r.batch_size, r.context_tokens_per_seq,
                 args.prompt_tokens)}
            for r in serving.roofline if r.batch_size <= args.max_num_seqs]


def _itl_lines(args: argparse.Namespace, budgets: list[dict]) -> list[str]:
    lines = [f"--max-num-batched-tokens for an ITL of {args.itl_ms:g} ms (a step with a full "
             "prefill chunk beside the decode batch)",
             f"  {'batch':>5}  {'max tokens':>10}"]
    lines += [f"  {b['batch_size']:>5}  {b['max_num_batched_tokens']:>10}" for b in budgets]
    if budgets:
        full = budgets[-1]
        if full["max_num_batched_tokens"] == 0:
            lines.append(f"  UNATTAINABLE: at batch {full['batch_size']} the decode step alone "
                         f"is over {args.itl_ms:g} ms; lower --max-num-seqs")
        elif args.max_num_batched_tokens > full["max_num_batched_tokens"]:
            lines.append(f"  WARNING: --max-num-batched-tokens {args.max_num_batched_tokens} "
                         f"stretches gaps past {args.itl_ms:g} ms at batch "
                         f"{full['batch_size']}; recommended {full['max_num_batched_tokens']}")
    return lines


def plan_to_dict(serving: ServingPlan) -> dict:
    out = dataclasses.asdict(serving.memory)
    out["fits"] = serving.memory.fits
    out["prefill_s"] = serving.prefill_s
    out["roofline"] = [dataclasses.asdict(r) for r in serving.roofline]
    out["timing_model"] = serving.timing_model
    return out


def _bytes(n: float) -> str:
    return f"{n / _GIB:,.2f} GiB" if n >= _GIB else f"{n / _MIB:,.1f} MiB"


def format_plan(serving: ServingPlan) -> str:
    return "\n".join(_memory_lines(serving.memory) + [""] + _roofline_lines(serving))


def _memory_lines(m: MemoryPlan) -> list[str]:
    rows = [
        ("GPU memory", f"{_bytes(m.gpu_memory_bytes)} ({m.gpu_memory_bytes:,} B)"),
        (f"budget (x{m.gpu_memory_utilization:g})", _bytes(m.budget_bytes)),
        ("weights", f"{_bytes(m.weight_bytes)} ({m.weight_bytes:,} B)"),
        ("activation workspace", _bytes(m.activation_bytes)),
        ("runtime reserve", _bytes(m.reserve_bytes)),
        ("KV cache", _bytes(m.kv_cache_bytes)),
        ("KV per token", f"{m.kv_bytes_per_token:,} B ({m.kv_bytes_per_token / 1024:g} KiB)"),
        (f"KV per block ({m.block_size} tokens)", _bytes(m.kv_bytes_per_block)),
        (f"KV per request ({m.prompt_tokens} + {m.output_tokens} tokens)",
         f"{_bytes(m.kv_bytes_per_request)} ({m.kv_bytes_per_request:,} B, "
         f"{m.blocks_per_request} {'new ' if m.prefix_hit_ratio else ''}blocks)"),
        ("KV blocks", f"{m.num_kv_blocks:,} ({m.kv_tokens:,} tokens)"),
        *([(f"cached prefix ({100 * m.prefix_hit_ratio:g} % of the prompt, held once)",
            f"{m.cached_prefix_blocks:,} blocks")] if m.prefix_hit_ratio else []),
        ("max concurrent requests", f"{m.max_concurrent_requests:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    head = [f"memory plan: {m.model} on {m.gpu}, bf16" if m.dtype_bytes == 2
            else f"memory plan: {m.model} on {m.gpu}, {m.dtype_bytes}-byte dtype"]
    lines = head + [f"  {k:<{width}}  {v}" for k, v in rows]
    if not m.fits:
        lines.append("  DOES NOT FIT: no room for one request's KV blocks")
    return lines


def _roofline_lines(serving: ServingPlan) -> list[str]:
    m = serving.memory
    if not serving.roofline:
        return ["decode roofline: none (no request fits)"]
    ctx = serving.roofline[0].context_tokens_per_seq
    lines = [f"decode roofline (context {ctx} tokens/seq = prompt + output/2); "
             f"prompt prefill {serving.prefill_s * 1e3:.1f} ms",
             f"  {'batch':>5}  {'GB moved':>8}  {'GFLOP':>8}  {'FLOP/B':>6}  {'bound':>7}  "
             f"{'roofline ms':>11}  {'predicted ms':>12}  {'tokens/s':>9}"]
    for r in serving.roofline:
        lines.append(_row_line(r))
    lines.append(f"  ({m.gpu}: ridge at {_ridge(serving):.0f} FLOP/B; predicted = "
                 f"engine.timing_model with its efficiencies and per-step overhead)")
    return lines


def _ridge(serving: ServingPlan) -> float:
    gpu = serving.timing_model["gpu"]
    return gpu["bf16_flops_per_s"] / gpu["hbm_bytes_per_s"]


def _row_line(r: RooflineRow) -> str:
    return (f"  {r.batch_size:>5}  {r.bytes_moved / 1e9:>8.2f}  {r.flops / 1e9:>8.1f}  "
            f"{r.arithmetic_intensity:>6.1f}  {r.bound:>7}  {r.roofline_step_s * 1e3:>11.2f}  "
            f"{r.predicted_step_s * 1e3:>12.2f}  {r.tokens_per_s:>9.0f}")


def _run_measure(args: argparse.Namespace, serving: ServingPlan) -> int:
    import torch

    if not torch.cuda.is_available():
        print("kvguard plan --measure: no CUDA device here; measuring needs a GPU "
              "(the plan itself works anywhere: drop --measure)", file=sys.stderr)
        return 2
    batches = [r.batch_size for r in serving.roofline if r.batch_size <= args.measure_max_batch]
    timing = TimingModel(model_preset(args.model), get_gpu(args.gpu))
    print(f"measuring on {torch.cuda.get_device_name()} against the {args.gpu} profile")
    print(f"  {'batch':>5}  {'measured ms':>11}  {'predicted ms':>12}  {'ratio':>5}")
    for batch, ctx, measured in measure_decode_steps(
            args.model, "cuda", "bfloat16", batches, args.prompt_tokens, args.measure_steps,
            args.block_size):
        predicted = timing.predict_s(0, batch, batch * ctx)
        print(f"  {batch:>5}  {measured * 1e3:>11.2f}  {predicted * 1e3:>12.2f}  "
              f"{measured / predicted:>5.2f}")
    return 0


def measure_decode_steps(model: str, device: str, dtype: str, batch_sizes: list[int],
                         prompt_tokens: int, num_steps: int,
                         block_size: int = 16) -> list[tuple[int, int, float]]:
    """Median decode-step wall time of the torch engine at each batch size:
    ``(batch, mean context tokens per seq, seconds)``. Random weights; prompts prefilled first."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if not batch_sizes:
        return []
    per_seq = -(-(prompt_tokens + num_steps + 2) // block_size)
    engine = LLMEngine.from_preset(model, device=device, dtype=dtype, block_size=block_size,
                                   num_blocks=per_seq * max(batch_sizes) + 1,
                                   max_num_seqs=max(batch_sizes))
    results = []
    for batch in batch_sizes:
        ids = [f"m{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, [(7 * j) % 1000 + 10 for j in range(prompt_tokens)],
                               SamplingParams(max_tokens=num_steps + 2, ignore_eos=True))
        durations, contexts = [], []
        while engine.has_unfinished_requests() and len(durations) < num_steps:
            record = engine.step().iteration
            if record is not None and record.num_prefill_tokens == 0:
                durations.append(record.duration_s)
                contexts.append(record.num_context_tokens / max(record.num_decode_seqs, 1))
        for rid in ids:
            engine.abort_request(rid)
        engine.step()
        if durations:
            results.append((batch, round(statistics.mean(contexts)), statistics.median(durations)))
    return results
