"""``ReplicaLimits``: what the guard learns about its replicas on every state refresh.

The :class:`~guard.request.rules.ReplicaRules` the pricer checks bodies against (the smallest
context length, the block size, the models served; with model routing, :meth:`rules_for` gives
a model's own: the smallest context among the replicas serving it, each replica's from its
``/v1/models`` entry for the model where it gives ``max_model_len``, else its state, else its
``[[replicas]] max_model_len``) and, once per replica that publishes its
own limits and step times (a kvguard engine; never from limits assumed for a vLLM replica), a
warning when a step with a full prefill chunk takes longer than the tightest class ITL: no
pacing then keeps running streams' gaps when a long prompt arrives (``kvguard plan --itl-ms``
sizes the chunk budget).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from guard.replicas.documents import UNKNOWN_MAX_MODEL_LEN
from guard.replicas.load_state import LoadState
from guard.request.rules import ReplicaRules
from policies.prefill_pacing import full_step_s
from policies.step_time import StepTimeModel

__all__ = ["ReplicaLimits"]

_log = logging.getLogger("guard.controller")  # where operators have always found this warning


class ReplicaLimits:
    """``rules`` for the replicas in ``load_state`` as of the last :meth:`update`."""

    MAX_CACHED_GROUPS = 1024  # (replicas, model) rules kept between two state refreshes

    def __init__(self, load_state: LoadState, itl_s: float,
                 configured_lengths: Mapping[str, int] | None = None) -> None:
        self._load_state = load_state
        self._itl_s = itl_s  # the tightest class ITL
        self.rules = ReplicaRules()
        self._warned: set[str] = set()  # replicas warned about their chunk budget
        self._configured = dict(configured_lengths or {})  # [[replicas]] max_model_len
        self._published: dict[str, int] = {}  # replica id -> the context its state gives
        # (replica id, model) -> the context its /v1/models gives for it (None: not given);
        # the proxy sets it from its model catalog
        self.model_context: Callable[[str, str], int | None] | None = None
        self._by_group: dict[tuple[frozenset[str], object], ReplicaRules] = {}

    def update(self) -> ReplicaRules:
        """Read the replicas' latest state: the rules (kept when no replica is known yet)."""
        # (no ranked fleet: this runs after every state round, and ranking is the decisions')
        replicas, step_time = self._load_state.views()
        if not replicas:
            return self.rules
        # a length no replica published (UNKNOWN_MAX_MODEL_LEN) is no limit
        published = {r.replica_id: r.max_model_len for r in replicas
                     if 0 < r.max_model_len < UNKNOWN_MAX_MODEL_LEN}
        lengths = list(published.values())
        self._published = published
        self._by_group.clear()
        served = self._load_state.served_models()
        self.rules = ReplicaRules(min(lengths) if lengths else None, replicas[0].block_size,
                                  served, strict=served is not None)
        self._warn_chunk_budget(replicas, step_time)
        return self.rules

    def rules_for(self, replica_ids: frozenset[str] | None, model: object) -> ReplicaRules:
        """The rules for a request of ``model`` routed among ``replica_ids`` (None: every
        replica, :attr:`rules`): the smallest context any of them serves the model with (none
        known: no guard-side check, the upstream checks)."""
        if replica_ids is None:
            return self.rules
        key = (replica_ids, model)
        rules = self._by_group.get(key)
        if rules is None:
            lengths = [n for rid in replica_ids
                       if (n := self._context(rid, model)) is not None]
            rules = dataclasses.replace(self.rules,
                                        max_model_len=min(lengths) if lengths else None)
            if len(self._by_group) >= self.MAX_CACHED_GROUPS:
                self._by_group.clear()
            self._by_group[key] = rules
        return rules

    def _context(self, replica_id: str, model: object) -> int | None:
        listed = self.model_context
        if listed is not None and isinstance(model, str):
            length = listed(replica_id, model)
            if length is not None:
                return length
        length = self._published.get(replica_id)
        return length if length is not None else self._configured.get(replica_id)

    def _warn_chunk_budget(self, replicas: tuple, step_time: StepTimeModel) -> None:
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
