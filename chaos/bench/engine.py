"""``kvguard bench engine``: our engine against Hugging Face ``transformers`` on the same weights.

A seeded mixed workload (prompt and output lengths drawn uniformly) runs at each concurrency
through (1) the paged continuous-batching engine, with a closed-loop client that keeps
``concurrency`` requests in flight, and (2) ``LlamaForCausalLM.generate()`` loaded with the very
same fp32 weights, in static batches of ``concurrency`` requests (left-padded, greedy,
``max_new_tokens`` = the batch's longest output; only each request's own tokens count as
output). Both decode greedily without stopping at EOS, so every request produces exactly its
``max_tokens``. The decode step at concurrency 1 is set against the memory-bandwidth roofline:
weight bytes / measured copy bandwidth.

Each system's output tokens/s is reported against wall time and, in the last column, against
the process CPU time it used: on a CPU shared with other work, wall time charges each system
for whatever else ran, CPU time does not (with ``--threads 1`` it is the work itself).
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BenchRequest", "RunResult", "Workload", "configure", "run", "run_engine", "run_hf"]


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 512
    min_output_tokens: int = 16
    max_output_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError("need 1 <= min_prompt_tokens <= max_prompt_tokens")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("need 1 <= min_output_tokens <= max_output_tokens")

    @property
    def max_total_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_output_tokens

    def requests(self, min_token_id: int, vocab_size: int) -> list[BenchRequest]:
        """Random prompts of ordinary (non-special) token ids, reproducible from ``seed``."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_requests):
            num_prompt = rng.randint(self.min_prompt_tokens, self.max_prompt_tokens)
            prompt = tuple(rng.randrange(min_token_id, vocab_size) for _ in range(num_prompt))
            max_tokens = rng.randint(self.min_output_tokens, self.max_output_tokens)
            out.append(BenchRequest(f"bench-{i}", prompt, max_tokens))
        return out


QUICK_WORKLOAD = Workload(num_requests=8, min_prompt_tokens=16, max_prompt_tokens=64,
                          min_output_tokens=4, max_output_tokens=16)


@dataclass(frozen=True)
class RunResult:
    system: str
    concurrency: int
    num_output_tokens: int
    wall_s: float
    num_steps: int
    mean_step_s: float
    mean_decode_step_s: float | None  # engine: steps with no prefill tokens
    outputs: dict[str, tuple[int, ...]]
    cpu_s: float = float("nan")  # process CPU time over the same span as wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def output_tokens_per_cpu_s(self) -> float:
        return self.num_output_tokens / self.cpu_s if self.cpu_s > 0 else float("nan")


def run_engine(engine, requests: Sequence[BenchRequest], concurrency: int,
               clock: Callable[[], float] = time.perf_counter) -> RunResult:
    """Closed loop: keep ``concurrency`` requests in the engine until all have finished."""
    from engine.sampling_params import SamplingParams

    pending = collections.deque(requests)
    in_flight: set[str] = set()
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    steps, decode_steps = [], []
    max_steps = 4 * sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    start_s, start_cpu_s = clock(), time.process_time()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            req = pending.popleft()
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(req.request_id, req.prompt_token_ids, params)
            in_flight.add(req.request_id)
        result = engine.step()
        if result.iteration is not None:
            steps.append(result.iteration.duration_s)
            if result.iteration.num_prefill_tokens == 0:
                decode_steps.append(result.iteration.duration_s)
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
        if len(steps) > max_steps:
            raise RuntimeError(f"engine did not finish the workload in {max_steps} steps")
    wall_s, cpu_s = clock() - start_s, time.process_time() - start_cpu_s
    return RunResult("kvguard", concurrency, sum(len(v) for v in outputs.values()), wall_s,
                     len(steps), _mean(steps), _mean(decode_steps) if decode_steps else None,
                     {k: tuple(v) for k, v in outputs.items()}, cpu_s)


def run_hf(model, requests: Sequence[BenchRequest], concurrency: int, pad_token_id: int,
           clock: Callable[[], float] = time.perf_counter) -> RunResult:
    """Static batches of ``concurrency`` requests through ``model.generate()``."""
    import torch
    from transformers import GenerationConfig

    outputs, wall_s, cpu_s, num_steps = {}, 0.0, 0.0, 0
    for i in range(0, len(requests), concurrency):
        batch = requests[i : i + concurrency]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, req in enumerate(batch):  # left padding
            ids[row, width - len(req.prompt_token_ids) :] = torch.tensor(req.prompt_token_ids)
            mask[row, width - len(req.prompt_token_ids) :] = 1
        max_new = max(r.max_tokens for r in batch)
        gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                               pad_token_id=pad_token_id)
        start_s, start_cpu_s = clock(), time.process_time()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        wall_s += clock() - start_s
        cpu_s += time.process_time() - start_cpu_s
        num_steps += max_new
        for row, req in enumerate(batch):
            outputs[req.request_id] = tuple(out[row, width : width + req.max_tokens].tolist())
    num_useful = sum(len(v) for v in outputs.values())
    return RunResult("transformers", concurrency, num_useful, wall_s, num_steps,
                     wall_s / num_steps, None, outputs, cpu_s)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def hf_llama(model_config, state_dict):
    """A ``transformers.LlamaForCausalLM`` holding ``state_dict`` (HF names), in fp32 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model_config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_model_len,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(hf_config)
    result = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if c.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ValueError(f"weights do not fit LlamaForCausalLM: {result}")
    return model.eval()


def copy_bandwidth_bytes_per_s(num_bytes: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` ``dst.copy_(src)`` rate, counting bytes read plus bytes written."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_s = math.inf
    for _ in range(repeats):
        start_s = time.perf_counter()
        dst.copy_(src)
        best_s = min(best_s, time.perf_counter() - start_s)
    return 2 * src.numel() * 4 / best_s


def weight_bytes(state_dict) -> int:
    """Bytes of distinct weight storage (tied embeddings counted once)."""
    seen, total = set(), 0
    for tensor in state_dict.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="engine preset (default: %(default)s)")
    parser.add_argument("--concurrency", default="1,4,16",
                        help="comma-separated concurrency levels (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_WORKLOAD.num_requests} short requests")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the transformers generate() reference")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both systems (default: torch's choice; "
                             "1 is steadier on a CPU shared with other work)")


def run(args: argparse.Namespace) -> int:
    import torch

    concurrencies = _parse_concurrency(args.concurrency)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    workload = QUICK_WORKLOAD if args.quick else Workload(num_requests=args.num_requests,
                                                          seed=args.seed)
    engine = _build_engine(args.model, workload, max(concurrencies), args.device)
    special = engine.tokenizer.special_token_ids if engine.tokenizer is not None else ()
    requests = workload.requests(max(special, default=-1) + 1, engine.config.model.vocab_size)
    model, skip_reason = _reference_model(engine, args.no_reference)
    _print_header(args, engine, workload, requests, torch.get_num_threads())
    run_engine(engine, [BenchRequest("warmup", requests[0].prompt_token_ids[:16], 4)], 1)
    if model is not None:
        run_hf(model, [BenchRequest("warmup", requests[0].prompt_token_ids[:16], 4)], 1, 0)
    rows = []
    for c in concurrencies:
        ours = run_engine(engine, [_renamed(r, c) for r in requests], c)
        print(f"  concurrency {c}: kvguard {ours.wall_s:.1f} s", flush=True)
        ref = run_hf(model, [_renamed(r, c) for r in requests], c, 0) if model else None
        if ref is not None:
            print(f"  concurrency {c}: transformers {ref.wall_s:.1f} s", flush=True)
        rows.append((ours, ref))
    print(format_table(rows))
    if skip_reason:
        print(f"reference: skipped ({skip_reason})")
    else:
        print(_agreement_line(rows[0]))
    print(_roofline_lines(engine, rows[0][0], small=args.quick))
    return 0


def _parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from exc
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def _build_engine(model: str, workload: Workload, max_concurrency: int, device: str):
    from engine.config import CacheConfig
    from engine.llm_engine import LLMEngine

    blocks_per_request = math.ceil(workload.max_total_tokens / CacheConfig().block_size) + 1
    return LLMEngine.from_preset(model, device=device, max_num_seqs=max_concurrency,
                                 num_blocks=max_concurrency * blocks_per_request)


def _reference_model(engine, disabled: bool):
    if disabled:
        return None, "--no-reference"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, "transformers is not installed: pip install 'kvguard[bench]'"
    return hf_llama(engine.config.model, engine.runner.model.hf_state_dict()), None


def _renamed(req: BenchRequest, concurrency: int) -> BenchRequest:
    return BenchRequest(f"c{concurrency}-{req.request_id}", req.prompt_token_ids, req.max_tokens)


def _print_header(args, engine, workload: Workload, requests, num_threads: int) -> None:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    print(f"kvguard bench engine: model {args.model}, device {args.device}, "
          f"dtype {engine.config.resolved_dtype()}, torch threads {num_threads}")
    print(f"workload: {workload.num_requests} requests (seed {workload.seed}), prompts "
          f"{workload.min_prompt_tokens}-{workload.max_prompt_tokens} tokens, outputs "
          f"{workload.min_output_tokens}-{workload.max_output_tokens} tokens; "
          f"{prompt_tokens} prompt + {output_tokens} output tokens in all; greedy, no EOS stop",
          flush=True)


def format_table(rows: Sequence[tuple[RunResult, RunResult | None]]) -> str:
    lines = ["| concurrency | kvguard out tok/s | kvguard mean step ms | transformers out tok/s "
             "| transformers mean step ms | kvguard / transformers | same, per CPU second |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for ours, ref in rows:
        ref_cells = (f"{ref.output_tokens_per_s:.1f} | {ref.mean_step_s * 1e3:.1f} | "
                     f"{ours.output_tokens_per_s / ref.output_tokens_per_s:.2f}x | "
                     f"{ours.output_tokens_per_cpu_s / ref.output_tokens_per_cpu_s:.2f}x"
                     if ref is not None else "skipped | skipped | - | -")
        lines.append(f"| {ours.concurrency} | {ours.output_tokens_per_s:.1f} | "
                     f"{ours.mean_step_s * 1e3:.1f} | {ref_cells} |")
    return "\n".join(lines)


def _agreement_line(row: tuple[RunResult, RunResult | None]) -> str:
    ours, ref = row
    same = sum(ours.outputs[k] == ref.outputs.get(k) for k in ours.outputs)
    return (f"greedy outputs identical to transformers at concurrency {ours.concurrency}: "
            f"{same}/{len(ours.outputs)} requests")


def _roofline_lines(engine, ours: RunResult, small: bool) -> str:
    num_bytes = weight_bytes(engine.runner.model.hf_state_dict())
    bandwidth = copy_bandwidth_bytes_per_s((64 if small else 512) << 20)
    roofline_s = num_bytes / bandwidth
    step_s = ours.mean_decode_step_s
    measured = ("no decode-only steps" if step_s is None else
                f"{step_s * 1e3:.1f} ms mean decode step, {roofline_s / step_s:.0%} of roofline")
    return (f"roofline at concurrency {ours.concurrency}: {num_bytes / 1e6:.1f} MB of weights / "
            f"{bandwidth / 1e9:.1f} GB/s copy bandwidth (read+write) = {roofline_s * 1e3:.1f} ms "
            f"per decode step; measured {measured}")
