"""The engine step-time model: pure prediction from fitted coefficients.

One engine iteration processing ``num_prefill_tokens`` prompt tokens and ``num_decode_seqs``
decoding sequences whose KV caches hold ``num_context_tokens`` tokens in total takes

    duration_s = base_s + per_prefill_token_s * num_prefill_tokens
                        + per_decode_seq_s * num_decode_seqs
                        + per_context_token_s * num_context_tokens

The prior comes from the roofline; the guard refits the coefficients online (least squares over
a sliding window of the engine's iteration records).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTimeModel"]


@dataclass(frozen=True)
class StepTimeModel:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_seq_s * num_decode_seqs
            + self.per_context_token_s * num_context_tokens
        )

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.base_s, self.per_prefill_token_s, self.per_decode_seq_s, self.per_context_token_s)
