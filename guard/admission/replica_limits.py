"""``ReplicaLimits``: what the guard learns about its replicas on every state refresh.

The :class:`~guard.request.rules.ReplicaRules` the pricer checks bodies against (the smallest
context length, the block size, the models served) and, once per replica that publishes its
own limits and step times (a kvguard engine; never from limits assumed for a vLLM replica), a
warning when a step with a full prefill chunk takes longer than the tightest class ITL: no
pacing then keeps running streams' gaps when a long prompt arrives (``kvguard plan --itl-ms``
sizes the chunk budget).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from guard.replicas.documents import UNKNOWN_MAX_MODEL_LEN
from guard.replicas.load_state import LoadState
from guard.request.rules import ReplicaRules
from policies.prefill_pacing import full_step_s

__all__ = ["ReplicaLimits"]

_log = logging.getLogger("guard.controller")  # where operators have always found this warning


class ReplicaLimits:
    """``rules`` for the replicas in ``load_state`` as of the last :meth:`update`."""

    def __init__(self, load_state: LoadState, clock: Callable[[], float], itl_s: float) -> None:
        self._load_state = load_state
        self._clock = clock
        self._itl_s = itl_s  # the tightest class ITL
        self.rules = ReplicaRules()
        self._warned: set[str] = set()  # replicas warned about their chunk budget

    def update(self) -> ReplicaRules:
        """Read the replicas' latest state: the rules (kept when no replica is known yet)."""
        replicas = self._load_state.snapshot(self._clock()).replicas
        if not replicas:
            return self.rules
        # a length no replica published (UNKNOWN_MAX_MODEL_LEN) is no limit
        lengths = [r.max_model_len for r in replicas if 0 < r.max_model_len < UNKNOWN_MAX_MODEL_LEN]
        served = self._load_state.served_models()
        self.rules = ReplicaRules(min(lengths) if lengths else None, replicas[0].block_size,
                                  served, strict=served is not None)
        self._warn_chunk_budget(replicas)
        return self.rules

    def _warn_chunk_budget(self, replicas: tuple) -> None:
        step_time = self._load_state.snapshot(self._clock()).step_time
        for r in replicas:
            # only what a replica published: assumed limits (vLLM) would warn about nothing real
            if r.limits_published and r.replica_id not in self._warned:
                step_s = full_step_s(r, step_time)
                if step_s > self._itl_s:
                    self._warned.add(r.replica_id)
                    _log.warning("replica %s: a step with a full %d-token prefill chunk takes "
                                 "%.0f ms, over the tightest class ITL (%.0f ms): long prompts "
                                 "will stretch running streams' gaps; lower its "
                                 "--max-num-batched-tokens (kvguard plan --itl-ms)",
                                 r.replica_id, r.max_num_batched_tokens, 1e3 * step_s,
                                 1e3 * self._itl_s)
