"""The roofline timing model: how long one engine step takes on a given GPU.

A step moves bytes (the weights once, the KV context of every sequence it attends over, the new
K/V it writes) and does FLOPs (2 per matmul parameter per token, plus attention). On a GPU it
cannot finish faster than either resource allows, so

    step_s = max(bytes / (hbm_bytes_per_s * bw_efficiency),
                 flops / (bf16_flops_per_s * flops_efficiency)) + overhead_s

How the three constants were chosen (public facts, then a check against published results):

* ``bw_efficiency = 0.95`` — well-tuned streaming kernels reach 90–95 % of the datasheet HBM
  bandwidth on A100/H100 (STREAM/BabelStream-style copy results), and batch-1 decode in an
  engine with CUDA graphs and fused kernels is a near-pure stream over the weights, so we take
  the top of that band. A 7B bf16 model (14.2 GB of matmul weights) then predicts 7.4 ms per
  batch-1 step on A100 (roofline 6.97 ms), 4.6 ms on H100 (4.24 ms), 3.2 ms on H200
  (2.96 ms): within 10 % of the bandwidth roofline.
* ``flops_efficiency = 0.50`` — cuBLAS bf16 GEMMs reach ~70–80 % of dense peak only at large
  square shapes; a whole decoder forward at serving shapes (M = a few hundred tokens, plus
  attention, norms, activations and sampling kernels) reaches about half of peak, the usual
  model-FLOPs utilisation reported for inference at saturation.
* ``overhead_s = 0.1 ms`` — per-step time the GPU is not busy with the above: kernel-launch
  gaps under CUDA graphs and sampling/scheduler work that is not overlapped (vLLM v0.6 hides
  most CPU work behind the GPU with multi-step scheduling and async output processing).

Check: `chaos.bench.sim` runs the scheduler on ShareGPT-like traffic (prompts ~230, outputs
~200 tokens) for an 8B model on A100-80GB and gets throughput within the ±30 % band of the
~4,100 (vLLM v0.6) / ~4,300 (SGLang v0.3) output tokens/s those projects publish
(docs/bench-sim.md has the numbers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.config import ModelConfig
from engine.gpus import GPUSpec
from engine.scheduler_output import SchedulerOutput

__all__ = ["StepShape", "StepCost", "TimingModel", "step_cost"]

DEFAULT_BW_EFFICIENCY = 0.95
DEFAULT_FLOPS_EFFICIENCY = 0.50
DEFAULT_OVERHEAD_S = 0.1e-3


@dataclass(frozen=True)
class StepShape:
    """The work of one step.

    ``num_context_tokens``: tokens cached before this step, summed over decoding sequences.
    ``num_prefill_cached_tokens``: tokens cached before this step, summed over prefilling
    sequences (chunked prefill reads them). ``num_prefill_attention_pairs``: (query, key) pairs
    the prefill tokens attend over; None estimates one causal chunk per step.
    ``num_sampled_seqs``: sequences that run the LM head; None means one per decoding sequence.
    """

    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_context_tokens: int = 0
    num_prefill_cached_tokens: int = 0
    num_prefill_attention_pairs: int | None = None
    num_sampled_seqs: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens",
                     "num_prefill_cached_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepShape.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    def prefill_attention_pairs(self) -> int:
        if self.num_prefill_attention_pairs is not None:
            return self.num_prefill_attention_pairs
        n = self.num_prefill_tokens
        return n * self.num_prefill_cached_tokens + n * (n + 1) // 2

    def sampled_seqs(self) -> int:
        if self.num_sampled_seqs is not None:
            return self.num_sampled_seqs
        return self.num_decode_seqs + (1 if self.num_prefill_tokens else 0)

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> StepShape:
        cached = pairs = 0
        for seq in out.scheduled:
            if seq.is_decode:
                continue
            n, c = seq.num_new_tokens, seq.num_computed_tokens
            cached += c
            pairs += n * c + n * (n + 1) // 2
        return cls(num_prefill_tokens=out.num_prefill_tokens,
                   num_decode_seqs=out.num_decode_seqs,
                   num_context_tokens=out.num_context_tokens,
                   num_prefill_cached_tokens=cached,
                   num_prefill_attention_pairs=pairs,
                   num_sampled_seqs=sum(1 for s in out.scheduled if s.samples))


@dataclass(frozen=True)
class StepCost:
    bytes_moved: float
    flops: float

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


def _matmul_params(model: ModelConfig) -> tuple[int, int]:
    """(per-token matmul parameters excluding the LM head, LM-head parameters). The input
    embedding is a table lookup, not a matmul, so it is neither read whole nor multiplied."""
    lm_head = model.vocab_size * model.hidden_size
    embedding = model.vocab_size * model.hidden_size
    body = model.num_params - embedding - (0 if model.tie_word_embeddings else lm_head)
    return body, lm_head


def step_cost(model: ModelConfig, shape: StepShape, dtype_bytes: int = 2) -> StepCost:
    """Bytes moved and FLOPs of one step (weights streamed once per step)."""
    if shape.num_tokens == 0:
        return StepCost(0.0, 0.0)
    body, lm_head = _matmul_params(model)
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes
    kv_read = shape.num_context_tokens + shape.num_prefill_cached_tokens
    bytes_moved = (body + lm_head) * dtype_bytes + kv_token * (kv_read + shape.num_tokens)
    attn_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim  # QK^T and AV
    decode_pairs = shape.num_context_tokens + shape.num_decode_seqs  # each attends to itself too
    flops = (2 * body * shape.num_tokens + 2 * lm_head * shape.sampled_seqs()
             + attn_per_pair * (decode_pairs + shape.prefill_attention_pairs()))
    return StepCost(float(bytes_moved), float(flops))


@dataclass(frozen=True)
class TimingModel:
    """Roofline step time for one model on one GPU (see the module docstring for constants)."""

    model: ModelConfig
    gpu: GPUSpec
    bw_efficiency: float = DEFAULT_BW_EFFICIENCY
    flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY
    overhead_s: float = DEFAULT_OVERHEAD_S
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("bw_efficiency", "flops_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")

    def cost(self, shape: StepShape) -> StepCost:
        return step_cost(self.model, shape, self.dtype_bytes)

    def memory_s(self, cost: StepCost) -> float:
        return cost.bytes_moved / (self.gpu.hbm_bytes_per_s * self.bw_efficiency)

    def compute_s(self, cost: StepCost) -> float:
        return cost.flops / (self.gpu.bf16_flops_per_s * self.flops_efficiency)

    def step_s(self, shape: StepShape) -> float:
        """Predicted wall time of one step; 0 for an empty step."""
        cost = self.cost(shape)
        if cost.bytes_moved == 0:
            return 0.0
        return max(self.memory_s(cost), self.compute_s(cost)) + self.overhead_s

    def predict_s(self, num_prefill_tokens: int, num_decode_seqs: int,
                  num_context_tokens: int) -> float:
        """Step time from an iteration record's three numbers (prefill as one causal chunk)."""
        return self.step_s(StepShape(num_prefill_tokens, num_decode_seqs, num_context_tokens))

    def as_dict(self) -> dict:
        """JSON-able parameters, for ``/kvguard/state``'s ``timing_model`` field."""
        return {
            "kind": "roofline",
            "model": self.model.name,
            "gpu": asdict(self.gpu),
            "bw_efficiency": self.bw_efficiency,
            "flops_efficiency": self.flops_efficiency,
            "overhead_s": self.overhead_s,
            "dtype_bytes": self.dtype_bytes,
            "step_time_prior": self.as_step_time_prior(),
        }

    def as_step_time_prior(self, max_num_seqs: int = 256,
                           max_num_batched_tokens: int = 2048) -> dict[str, float]:
        """Linear coefficients for ``policies.step_time.StepTimeModel`` (keys ``base_s``,
        ``per_prefill_token_s``, ``per_decode_seq_s``, ``per_context_token_s``).

        The roofline is a max of two lines, so no single line matches it everywhere; this is
        the non-negative least-squares fit (in relative error) of the linear form to the
        roofline over the step shapes an engine with these limits runs: decode batches of
        1 … ``max_num_seqs`` at several context lengths, prefill chunks up to
        ``max_num_batched_tokens``, and mixes of both. The guard refits it online.
        """
        rows, targets = [], []
        for p, d, c in _prior_grid(max_num_seqs, max_num_batched_tokens):
            rows.append((1.0, p, d, c))
            targets.append(self.predict_s(p, d, c))
        coef = _nonnegative_lstsq(np.array(rows), np.array(targets))
        keys = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")
        return {k: float(v) for k, v in zip(keys, coef, strict=True)}


def _prior_grid(max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int, int]]:
    batches = sorted({min(2**i, max_num_seqs) for i in range(12)} | {max_num_seqs})
    chunks = sorted({min(2**i, max_num_batched_tokens) for i in range(4, 16)})
    grid = [(0, b, b * ctx) for b in batches for ctx in (128, 512, 2048)]
    grid += [(p, 0, 0) for p in chunks]
    grid += [(p, b, b * 512) for p in chunks[::2] for b in batches[::2]
             if p + b <= max_num_batched_tokens]
    return grid


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares in relative error with coefficients clamped >= 0 (active-set: drop the
    most negative column and refit until none is negative)."""
    weights = 1.0 / y
    a_w, y_w = a * weights[:, None], y * weights
    active = list(range(a.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(a_w[:, active], y_w, rcond=None)
        if sol.min() >= 0 or len(active) == 1:
            break
        active.pop(int(np.argmin(sol)))
    coef = np.zeros(a.shape[1])
    coef[active] = np.maximum(sol, 0.0)
    return coef
