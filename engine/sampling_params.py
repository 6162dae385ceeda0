"""How one request wants its tokens sampled and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    ``temperature == 0`` means greedy. ``top_k=None`` and ``top_p=1.0`` disable those filters.
    ``seed`` makes the request's random draws reproducible (its own ``torch.Generator``).
    ``stop`` strings need a detokenize callback on the engine; the token that completes a stop
    string is still emitted, and the server trims the text at the stop string.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls, max_tokens: int, **kwargs) -> SamplingParams:
        """Greedy decoding (temperature 0), the mode the equivalence tests use."""
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)
