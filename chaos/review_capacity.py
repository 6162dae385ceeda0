"""C for ``kvguard review``: what one sim replica serves of a scenario's traffic, in GPU time.

The sim's step time is the roofline (``engine.timing_model``), so a replica's saturation
throughput follows from its flags and the traffic's mean lengths without a measuring run:
at saturation every step is full, ``max_num_batched_tokens`` tokens of which ``D`` are one
token per decoding stream and the rest prefill chunks. A request needs ``P`` prefill tokens and
``O − 1`` decode tokens (its first token comes from the prefill step), so in steady state

    requests finished per step  λ = B / (P + O − 1),   decoding streams  D = λ (O − 1),

each step a prefill chunk of ``B − D`` tokens (attending to half the prompt, on average, from
earlier chunks) beside ``D`` streams of context ``P + O/2``; C = λ ÷ that step's time × the
fleet's ``step_time_factor``. When ``max_num_seqs`` or the KV pool cannot hold ``D`` streams,
``D`` is capped there and λ follows from it.

A fixed nominal C (24 req/s per replica, the chaos runs' figure for 512–2,048-token prompts)
was the review's C before: below this traffic's saturation, so its "1.16 C" burst did not
overload the baseline. The sim process also spends CPU per step, so on a loaded machine a
replica serves a few per cent less than this; C is the model's figure, not a measurement.
"""

from __future__ import annotations

from chaos.schedule import LengthDist
from engine.config import model_preset
from engine.gpus import get_gpu
from engine.planner import num_kv_blocks
from engine.timing_model import StepShape, TimingModel

__all__ = ["mean_tokens", "replica_capacity_gpu_rps"]

BLOCK_SIZE = 16


def mean_tokens(dist: LengthDist) -> float:
    """The mean of a length distribution (a lognormal's median: near enough for its use)."""
    return (dist.low + dist.high) / 2 if dist.kind != "lognormal" else float(dist.median)


def replica_capacity_gpu_rps(engine, prompt: LengthDist, output: LengthDist,
                             cached_prompt_tokens: float = 0.0) -> float:
    """Saturation requests per GPU second of one replica with ``engine``'s flags
    (``chaos.review_fleet.EngineFlags``) on this traffic; ``cached_prompt_tokens`` of each
    prompt found in the prefix cache (not computed)."""
    timing = TimingModel(model_preset(engine.model), get_gpu(engine.gpu))
    p = max(1.0, mean_tokens(prompt) - cached_prompt_tokens)
    o = max(1.0, mean_tokens(output))
    ctx = mean_tokens(prompt) + o / 2
    budget = engine.max_num_batched_tokens
    lam = budget / (p + o - 1)
    decoding = lam * (o - 1)
    blocks = engine.num_blocks or num_kv_blocks(
        timing.model, timing.gpu, max_num_batched_tokens=budget, max_num_seqs=engine.max_num_seqs)
    max_streams = min(engine.max_num_seqs, blocks * BLOCK_SIZE / (mean_tokens(prompt) + o))
    if decoding > max_streams:
        decoding = max_streams
        lam = decoding / max(o - 1, 1e-9)
    chunk = max(1, round(min(budget - decoding, lam * p)))
    shape = StepShape(num_prefill_tokens=chunk, num_decode_seqs=round(decoding),
                      num_context_tokens=round(decoding * ctx),
                      num_prefill_cached_tokens=round(cached_prompt_tokens + max(0.0, p - chunk) / 2))
    return lam / (timing.step_s(shape) * engine.step_time_factor)
