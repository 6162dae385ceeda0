"""Capacity planner: where a GPU's memory goes, and what one serving step costs.

Memory (the same split vLLM makes at start-up):

    budget      = floor(memory_bytes * gpu_memory_utilization)
    kv_bytes    = budget - weights - activation workspace - runtime reserve
    num_blocks  = floor(kv_bytes / (block_size * kv_bytes_per_token))

* weights: ``ModelConfig.num_params`` × dtype bytes.
* activation workspace (an estimate of the peak of one forward pass, which vLLM measures by
  profiling a dummy batch): ``max_num_batched_tokens`` tokens each holding the residual stream
  and its normed copy, the attention output, the Q/K/V projections and the SwiGLU gate, up and
  product (``(3·hidden + (q_heads + 2·kv_heads)·head_dim + 3·intermediate)`` × dtype bytes),
  plus fp32 logits and probabilities for ``max_num_seqs`` sampled rows (2 × 4 × vocab bytes).
* runtime reserve: 1 GiB for what the caching allocator does not see — CUDA context, cuBLAS
  workspaces, CUDA-graph pools (of the order vLLM reports as "non-torch memory").

Roofline: one decode step per batch size, each sequence holding the request's mean decode
context (prompt + output / 2), priced by ``engine.timing_model``.

Prefix caching (``prefix_hit_ratio`` h, the share of each prompt found in the cache — a shared
system prompt, say): a request newly allocates only ``ceil((prompt · (1 - h) + output) /
block_size)`` blocks, and the cached prefix's ``ceil(prompt · h / block_size)`` blocks are held
once for all of them (one shared prefix), so ``max concurrent = (blocks - prefix blocks) ÷ new
blocks per request``; its prefill computes only the uncached ``prompt · (1 - h)`` tokens, each
chunk attending to the cached prefix. Decode steps are unchanged: every sequence still reads
its whole context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.gpus import GPUSpec
from engine.timing_model import StepShape, TimingModel

__all__ = [
    "MemoryPlan",
    "RooflineRow",
    "ServingPlan",
    "activation_bytes",
    "batch_sizes",
    "kv_bytes_per_token",
    "num_kv_blocks",
    "plan",
    "plan_memory",
    "plan_roofline",
    "prefill_s",
    "max_batched_tokens_for_itl",
]

RUNTIME_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    gpu: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    dtype_bytes: int
    block_size: int
    prompt_tokens: int
    output_tokens: int
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    kv_cache_bytes: int  # 0 when the weights and workspace do not fit
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_bytes_per_request: int
    blocks_per_request: int  # blocks a request newly allocates (its cached prefix not counted)
    num_kv_blocks: int
    max_concurrent_requests: int
    prefix_hit_ratio: float = 0.0  # share of each prompt served from the prefix cache
    cached_prefix_blocks: int = 0  # the shared cached prefix, held once

    @property
    def fits(self) -> bool:
        return self.max_concurrent_requests > 0

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class RooflineRow:
    batch_size: int
    context_tokens_per_seq: int
    bytes_moved: float
    flops: float
    arithmetic_intensity: float
    bound: str  # "memory" | "compute"
    roofline_step_s: float  # at 100 % of datasheet bandwidth / peak, no overhead
    predicted_step_s: float  # the timing model (efficiencies + overhead)
    tokens_per_s: float  # batch_size / predicted_step_s


@dataclass(frozen=True)
class ServingPlan:
    memory: MemoryPlan
    roofline: tuple[RooflineRow, ...]
    prefill_s: float  # the prompt alone, in chunks of max_num_batched_tokens, predicted
    timing_model: dict


def activation_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                     dtype_bytes: int = 2) -> int:
    """Peak workspace estimate of one forward pass (see the module docstring)."""
    per_token = (3 * model.hidden_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                 + 3 * model.intermediate_size) * dtype_bytes
    logits = 2 * 4 * model.vocab_size * max_num_seqs
    return per_token * max_num_batched_tokens + logits


def plan_memory(model: ModelConfig, gpu: GPUSpec, prompt_tokens: int, output_tokens: int,
                gpu_memory_utilization: float = 0.9, dtype_bytes: int = 2,
                block_size: int = 16, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 256, prefix_hit_ratio: float = 0.0) -> MemoryPlan:
    _check_inputs(prompt_tokens, output_tokens, gpu_memory_utilization, block_size)
    if not 0.0 <= prefix_hit_ratio < 1.0:
        raise ValueError(f"prefix_hit_ratio must be in [0, 1), got {prefix_hit_ratio}")
    budget = math.floor(gpu.memory_bytes * gpu_memory_utilization)
    weights = model.num_params * dtype_bytes
    workspace = activation_bytes(model, max_num_batched_tokens, max_num_seqs, dtype_bytes)
    kv_cache = max(budget - weights - workspace - RUNTIME_RESERVE_BYTES, 0)
    per_token = kv_bytes_per_token(model, dtype_bytes)
    per_block = per_token * block_size
    num_blocks = kv_cache // per_block
    num_cached = cached_prompt_tokens(prompt_tokens, prefix_hit_ratio, block_size)
    blocks_per_request = math.ceil((prompt_tokens - num_cached + output_tokens) / block_size)
    prefix_blocks = num_cached // block_size
    return MemoryPlan(
        model=model.name, gpu=gpu.name, gpu_memory_bytes=gpu.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization, dtype_bytes=dtype_bytes,
        block_size=block_size, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        budget_bytes=budget, weight_bytes=weights, activation_bytes=workspace,
        reserve_bytes=RUNTIME_RESERVE_BYTES, kv_cache_bytes=kv_cache,
        kv_bytes_per_token=per_token, kv_bytes_per_block=per_block,
        kv_bytes_per_request=per_token * (prompt_tokens + output_tokens),
        blocks_per_request=blocks_per_request, num_kv_blocks=num_blocks,
        max_concurrent_requests=max(0, num_blocks - prefix_blocks) // blocks_per_request,
        prefix_hit_ratio=prefix_hit_ratio, cached_prefix_blocks=prefix_blocks,
    )


def cached_prompt_tokens(prompt_tokens: int, prefix_hit_ratio: float, block_size: int) -> int:
    """The prompt tokens a hit ratio saves: whole blocks, never the last prompt token."""
    num_cached = min(int(prompt_tokens * prefix_hit_ratio), prompt_tokens - 1)
    return num_cached - num_cached % block_size


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V, every layer, one token: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes


def num_kv_blocks(model: ModelConfig, gpu: GPUSpec, gpu_memory_utilization: float = 0.9,
                  dtype_bytes: int = 2, block_size: int = 16, max_num_batched_tokens: int = 2048,
                  max_num_seqs: int = 256) -> int:
    """The KV pool size an engine gets on ``gpu`` (0 when the model does not fit)."""
    return plan_memory(model, gpu, 1, 1, gpu_memory_utilization, dtype_bytes, block_size,
                       max_num_batched_tokens, max_num_seqs).num_kv_blocks


def _check_inputs(prompt_tokens: int, output_tokens: int, utilization: float,
                  block_size: int) -> None:
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt_tokens and output_tokens must be >= 1, got "
                         f"{prompt_tokens} and {output_tokens}")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, … up to ``max_batch``, and ``max_batch`` itself."""
    if max_batch < 1:
        return ()
    sizes = {2**i for i in range(max_batch.bit_length()) if 2**i <= max_batch}
    return tuple(sorted(sizes | {max_batch}))


def roofline_row(timing: TimingModel, batch_size: int, context_tokens: int) -> RooflineRow:
    shape = StepShape(num_decode_seqs=batch_size, num_context_tokens=batch_size * context_tokens)
    cost = timing.cost(shape)
    memory_s = cost.bytes_moved / timing.gpu.hbm_bytes_per_s
    compute_s = cost.flops / timing.gpu.bf16_flops_per_s
    predicted = timing.step_s(shape)
    return RooflineRow(
        batch_size=batch_size, context_tokens_per_seq=context_tokens,
        bytes_moved=cost.bytes_moved, flops=cost.flops,
        arithmetic_intensity=cost.arithmetic_intensity,
        bound="memory" if memory_s >= compute_s else "compute",
        roofline_step_s=max(memory_s, compute_s), predicted_step_s=predicted,
        tokens_per_s=batch_size / predicted,
    )


def plan_roofline(timing: TimingModel, memory: MemoryPlan) -> tuple[RooflineRow, ...]:
    context = memory.prompt_tokens + memory.output_tokens // 2
    return tuple(roofline_row(timing, b, context)
                 for b in batch_sizes(memory.max_concurrent_requests))


def prefill_s(timing: TimingModel, prompt_tokens: int, chunk_tokens: int,
              num_cached_tokens: int = 0) -> float:
    """Predicted time to prefill one prompt alone, chunked as the scheduler does (its first
    ``num_cached_tokens`` found in the prefix cache: attended to, not computed)."""
    total, done = 0.0, num_cached_tokens
    while done < prompt_tokens:
        n = min(chunk_tokens, prompt_tokens - done)
        total += timing.step_s(StepShape(num_prefill_tokens=n, num_prefill_cached_tokens=done))
        done += n
    return total


def max_batched_tokens_for_itl(timing: TimingModel, itl_s: float, num_decode_seqs: int,
                               context_tokens_per_seq: int, prompt_tokens: int,
                               max_tokens: int = 1 << 17) -> int:
    """The largest ``--max-num-batched-tokens`` whose full step — one token per decoding
    sequence plus a prefill chunk of the rest, the chunk's prompt already cached up to its end —
    still ends within ``itl_s``, so a prefill never stretches a running stream's gap past its
    limit. 0 when even the decode step alone is over ``itl_s``."""
    if itl_s <= 0 or num_decode_seqs < 0 or context_tokens_per_seq < 0 or prompt_tokens < 1:
        raise ValueError("need itl_s > 0, num_decode_seqs >= 0, context >= 0, prompt >= 1")

    def fits(num_prefill: int) -> bool:
        shape = StepShape(num_prefill_tokens=num_prefill, num_decode_seqs=num_decode_seqs,
                          num_context_tokens=num_decode_seqs * context_tokens_per_seq,
                          num_prefill_cached_tokens=max(0, prompt_tokens - num_prefill))
        return timing.step_s(shape) <= itl_s

    if not fits(0):
        return 0
    low, high = 0, max_tokens  # fits(low) holds; find the largest such chunk
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low + num_decode_seqs


def plan(model: ModelConfig, gpu: GPUSpec, prompt_tokens: int, output_tokens: int,
         gpu_memory_utilization: float = 0.9, block_size: int = 16,
         max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
         timing: TimingModel | None = None, prefix_hit_ratio: float = 0.0) -> ServingPlan:
    """Memory plan + decode roofline + prompt prefill time for one request shape (with
    ``prefix_hit_ratio`` of each prompt served from the prefix cache)."""
    timing = timing or TimingModel(model, gpu)
    memory = plan_memory(model, gpu, prompt_tokens, output_tokens, gpu_memory_utilization,
                         timing.dtype_bytes, block_size, max_num_batched_tokens, max_num_seqs,
                         prefix_hit_ratio)
    prefill = prefill_s(timing, prompt_tokens, max_num_batched_tokens,
                        cached_prompt_tokens(prompt_tokens, prefix_hit_ratio, block_size))
    return ServingPlan(memory=memory, roofline=plan_roofline(timing, memory), prefill_s=prefill,
                       timing_model=timing.as_dict())
