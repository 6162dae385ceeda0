"""What one request costs: the priced request a policy decides on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RequestClass", "RequestCost"]


@dataclass(frozen=True)
class RequestClass:
    """A named SLO class. Lower ``priority`` is more important (shed last)."""

    name: str
    ttft_s: float
    itl_s: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("request class needs a name")
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"class {self.name!r}: ttft_s and itl_s must be > 0")


# Built for every request: slotted, not frozen (a frozen __init__ sets each field through
# object.__setattr__; docs/benchmarks.md §2). Never mutated after construction.
@dataclass(slots=True)
class RequestCost:
    """A request priced in tokens and KV blocks.

    ``arrival_s`` and ``deadline_s`` are on the guard's injected clock (monotonic seconds).
    ``deadline_s`` is when the first token must have been sent to meet the class TTFT (or the
    client's own deadline, whichever is earlier).

    ``cached_prefix_tokens`` maps a replica id to the prompt tokens its prefix cache is expected
    to hold for this request (the guard's prefix-cache view; absent replicas hold none).
    ``num_blocks`` and ``num_prompt_tokens`` stay the request's whole worst case (what it needs
    on a cold replica); :meth:`num_new_blocks_on` and :meth:`num_uncached_prompt_tokens_on` are
    what it newly allocates and prefills on one replica. ``prefix_key`` is the guard's own
    key of the prompt's prefix (opaque to policies), so the guard can record where it went.
    """

    request_id: str
    tenant: str
    request_class: RequestClass
    num_prompt_tokens: int
    max_tokens: int
    num_expected_output_tokens: int
    num_blocks: int
    arrival_s: float
    deadline_s: float
    is_retry: bool = False
    # the client software its User-Agent names (policies.client_patience.client_software):
    # client patience is learned per tenant and client software
    client: str = ""
    cached_prefix_tokens: Mapping[str, int] | None = None  # replica id -> cached prompt tokens
    prefix_key: object = None
    # the replicas that serve the request's model (None: any replica); the guard restricts
    # the snapshot to them before the policy decides, so a policy never sees the others
    replica_ids: frozenset[str] | None = None

    def num_cached_tokens_on(self, replica_id: str, block_size: int) -> int:
        """Prompt tokens a replica's prefix cache saves this request: whole blocks only, and
        never the last prompt token (an engine always computes at least one)."""
        cached = self.cached_prefix_tokens
        if not cached:
            return 0
        num_cached = cached.get(replica_id, 0)
        if num_cached <= 0:
            return 0
        num_cached = min(num_cached, self.num_prompt_tokens - 1)
        return num_cached - num_cached % block_size if num_cached > 0 else 0

    def num_uncached_prompt_tokens_on(self, replica_id: str, block_size: int) -> int:
        """Prompt tokens the replica must prefill (the rest is its cache hit)."""
        return self.num_prompt_tokens - self.num_cached_tokens_on(replica_id, block_size)

    def num_new_blocks_on(self, replica_id: str, block_size: int) -> int:
        """Blocks the request newly allocates there: its worst case less the cached blocks it
        shares (taken off once, whatever ``n``: conservative for several choices)."""
        return self.num_blocks - self.num_cached_tokens_on(replica_id, block_size) // block_size

    def footprint_at_best_hit(self) -> tuple[int, int]:
        """Prompt tokens to prefill and KV blocks to allocate on the replica expected to hold
        the most of the request's prefix (the whole prompt and ``num_blocks`` when none holds
        any): what a request waiting in the guard's queue is counted as by the requests behind
        it (:class:`policies.snapshot.QueuedAhead`), since the policy sends it where its
        prefix is. The blocks it shares are its worst case's share of the cached tokens
        (the pricer's block size is not kept on the cost), rounded down."""
        cached = self.cached_prefix_tokens
        if not cached:
            return self.num_prompt_tokens, self.num_blocks
        hit = min(max(cached.values()), self.num_prompt_tokens - 1)
        if hit <= 0:
            return self.num_prompt_tokens, self.num_blocks
        num_tokens = self.num_prompt_tokens + self.max_tokens
        return (self.num_prompt_tokens - hit,
                self.num_blocks - self.num_blocks * hit // num_tokens if num_tokens else 0)

    def best_hit_replicas(self) -> tuple[str, ...]:
        """The replicas expected to hold the most of the request's prefix (those
        :meth:`footprint_at_best_hit` prices it at), in id order; empty when none holds any:
        where a request waiting in the guard's queue is expected to go."""
        cached = self.cached_prefix_tokens
        if not cached:
            return ()
        most = max(cached.values())
        if min(most, self.num_prompt_tokens - 1) <= 0:
            return ()
        return tuple(sorted(rid for rid, n in cached.items() if n == most))

    @property
    def num_reserved_tokens(self) -> int:
        """Worst-case tokens this request may hold: prompt + max_tokens."""
        return self.num_prompt_tokens + self.max_tokens
