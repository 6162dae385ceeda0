"""What one request costs: the priced request a policy decides on."""

from __future__ import annotations

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
    # the replicas that serve the request's model (None: any replica); the guard restricts
    # the snapshot to them before the policy decides, so a policy never sees the others
    replica_ids: frozenset[str] | None = None

    @property
    def num_reserved_tokens(self) -> int:
        """Worst-case tokens this request may hold: prompt + max_tokens."""
        return self.num_prompt_tokens + self.max_tokens
