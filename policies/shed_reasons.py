"""Every shed reason, in one place: the ``x-kvguard-reason`` values and metric labels.

Policies and the guard import their reasons from here; :data:`NEVER_RETRY` lists the reasons
after which sending the same request again cannot help (the guard answers them with
``x-should-retry: false`` and no wait, whatever else it knows).
"""

from __future__ import annotations

__all__ = [
    "ALL_REASONS",
    "CONCURRENCY_LIMIT",
    "CONTEXT_LENGTH_EXCEEDED",
    "ITL_WAIT",
    "KV_WAIT",
    "NEVER_RETRY",
    "NO_KV_CAPACITY",
    "NO_REPLICA",
    "QUEUE_FULL",
    "QUEUE_TIMEOUT",
    "RETRY_SHED",
    "SATURATED",
    "SHUTTING_DOWN",
    "SLO_UNATTAINABLE",
    "STALE_STATE",
    "TPM_LIMIT",
]

# policies
SLO_UNATTAINABLE = "slo_unattainable"  # no replica can meet the class SLO now
NO_KV_CAPACITY = "no_kv_capacity"  # 503: no free blocks now; 400: never fits any replica
STALE_STATE = "stale_state"  # replica state too old (or unknown capacity) and the cap is reached
RETRY_SHED = "retry_shed"  # a retry from a tenant whose retries crowd out first attempts
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over every context
KV_WAIT = "kv_wait"  # queued: waiting for KV blocks
ITL_WAIT = "itl_wait"  # queued: joining now would push a running stream past its ITL
NO_REPLICA = "no_replica"  # no healthy replica
CONCURRENCY_LIMIT = "concurrency_limit"  # a concurrency cap (fixed or adaptive)
SATURATED = "saturated"  # queue depth or KV utilisation over the saturation threshold
TPM_LIMIT = "tpm_limit"  # a token-rate limit
# the guard's admission queue
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
SHUTTING_DOWN = "shutting_down"  # the guard is draining (SIGTERM): retry on another replica

ALL_REASONS = (SLO_UNATTAINABLE, NO_KV_CAPACITY, STALE_STATE, RETRY_SHED,
               CONTEXT_LENGTH_EXCEEDED, NO_REPLICA, CONCURRENCY_LIMIT, SATURATED, TPM_LIMIT,
               QUEUE_FULL, QUEUE_TIMEOUT, SHUTTING_DOWN)
# a retry storm is what retry_shed exists to stop: telling the client to retry feeds it
NEVER_RETRY = frozenset({RETRY_SHED, CONTEXT_LENGTH_EXCEEDED})
