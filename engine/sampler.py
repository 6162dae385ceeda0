"""Turn one row of logits per sampling sequence into one token id each.

Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
top-p, and drawn with the exponential-race trick (argmax of p / Exp(1)), which equals a
categorical draw; seeded requests draw from their own ``torch.Generator``.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

__all__ = ["Sampler"]


class Sampler:
    """Holds per-request generators (for ``seed``) and one shared generator for the rest."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """logits [N, V] (float32) → N token ids."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
            drawn = [self._draw(probs[j], request_ids[i], params[i])
                     for j, i in enumerate(random_rows)]
            tokens[rows] = torch.stack(drawn)
        return tokens.tolist()

    def _draw(self, probs: torch.Tensor, request_id: str, params: SamplingParams) -> torch.Tensor:
        gen = self._generator(request_id, params)
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / noise).argmax()

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k / top-p mass removed; [N, V]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temps
    needs_filter = any(p.top_k is not None or p.top_p < 1.0 for p in params)
    if needs_filter:
        logits = _apply_top_k_top_p(logits, params)
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    top_p = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
    drop = (mass_before >= top_p) & (top_p < 1.0)  # keep the smallest prefix reaching top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
