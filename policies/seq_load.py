"""``SeqLoad``: one request on a replica, as a policy sees it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SeqLoad"]


@dataclass(frozen=True)
class SeqLoad:
    """One request on a replica as the engine (or the guard's reservation) reports it."""

    num_context_tokens: int  # tokens in the KV cache now (prompt computed so far + output)
    num_prefill_tokens_remaining: int  # prompt tokens not yet prefilled
    num_remaining_output_tokens: int  # expected decode tokens still to come
    itl_s: float | None = None  # ITL limit of its class if known (guard-admitted requests)
    admitted_s: float | None = None  # a guard reservation: when it was admitted (guard clock)
