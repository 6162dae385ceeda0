"""Fixed-window token-rate limit: LiteLLM's per-key TPM (tokens per minute) limit.

Each tenant (or the whole service with ``per_tenant=False``) may use ``tokens_per_minute``
tokens per fixed 60 s window, the window being ``floor(now_s / 60)`` on the guard's clock.
A request is charged its worst case, prompt + ``max_tokens``, when the guard admits it (never
at decide: rejected requests cost nothing) and settled to its actual prompt + output tokens at
completion when that happens in the same window (LiteLLM counts the tokens a response actually
used). A request that would take the window over the limit gets 429 ``tpm_limit`` with
``retry_after_s`` = time to the window's end; one larger than a whole window never fits
(``should_retry=False``). Admitted requests go to the least-loaded healthy replica.
"""

from __future__ import annotations

import math

from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision, Shed
from policies.least_loaded import route_least_loaded
from policies.param_check import check_int
from policies.shed_reasons import TPM_LIMIT
from policies.snapshot import LoadSnapshot

__all__ = ["TokenRate", "TPM_LIMIT", "WINDOW_S"]

WINDOW_S = 60.0
_ALL_TENANTS = "*"


class TokenRate:
    name = "token-rate"

    def __init__(self, tokens_per_minute: int = 1_000_000, per_tenant: bool = True) -> None:
        self.tokens_per_minute = check_int("tokens_per_minute", tokens_per_minute, 1)
        self.per_tenant = bool(per_tenant)
        self._window = -1  # index of the window the counts belong to
        self._num_used_tokens: dict[str, int] = {}
        self._charges: dict[str, tuple[int, str, int]] = {}  # request id -> (window, key, tokens)

    def num_used_tokens(self, tenant: str, now_s: float) -> int:
        """Tokens charged to ``tenant`` (or everyone) in the window containing ``now_s``."""
        if _window_of(now_s) != self._window:
            return 0
        return self._num_used_tokens.get(self._key(tenant), 0)

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        now_s = snapshot.now_s
        if cost.num_reserved_tokens > self.tokens_per_minute:
            return Shed(429, TPM_LIMIT, should_retry=False)
        if (
            self.num_used_tokens(cost.tenant, now_s) + cost.num_reserved_tokens
            > self.tokens_per_minute
        ):
            window_end_s = (_window_of(now_s) + 1) * WINDOW_S
            return Shed(429, TPM_LIMIT, retry_after_s=window_end_s - now_s)
        return route_least_loaded(snapshot)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        window = self._roll(now_s)
        key = self._key(cost.tenant)
        self._num_used_tokens[key] = self._num_used_tokens.get(key, 0) + cost.num_reserved_tokens
        self._charges[cost.request_id] = (window, key, cost.num_reserved_tokens)

    def observe(self, sample: CompletionSample) -> None:
        charge = self._charges.pop(sample.request_id, None)
        if charge is None:
            return
        window, key, num_charged = charge
        if window != self._roll(sample.now_s):
            return  # charged in an earlier window, which is gone
        num_actual = sample.num_prompt_tokens + sample.num_output_tokens
        refund = max(0, num_charged - num_actual)
        self._num_used_tokens[key] = self._num_used_tokens.get(key, 0) - refund

    def _key(self, tenant: str) -> str:
        return tenant if self.per_tenant else _ALL_TENANTS

    def _roll(self, now_s: float) -> int:
        window = _window_of(now_s)
        if window != self._window:
            self._window = window
            self._num_used_tokens = {}
        return window


def _window_of(now_s: float) -> int:
    return math.floor(now_s / WINDOW_S)
