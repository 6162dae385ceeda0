"""The budget store a guard configuration asks for.

No tenant (and no default) with a limit: no store at all (the guard skips budgets). Limits and no
``redis_url``: the in-memory store. Limits and a ``redis_url``: Redis with the local-share
fallback (it connects in the background, so a guard starts even while Redis is down).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from guard.budget.memory_store import MemoryStore
from guard.budget.metrics import BudgetMetrics
from guard.budget.store import BudgetStore

if TYPE_CHECKING:  # guard.config imports guard.budget.config: no import at run time
    from guard.config import GuardConfig

__all__ = ["build_budget_store"]


def build_budget_store(config: GuardConfig, clock: Callable[[], float],
                       registry: CollectorRegistry | None = None) -> BudgetStore | None:
    """The store for ``config`` (None when no budget is configured); metrics on ``registry``."""
    if not config.budgets_enabled:
        return None
    metrics = BudgetMetrics(registry, config.max_tenant_labels) if registry is not None else None
    if config.redis_url is None:
        on_reclaim = metrics.reclaimed.inc if metrics is not None else None
        store = MemoryStore(config.budget_limits, clock, on_reclaim=on_reclaim)
        if metrics is not None:
            metrics.watch_remaining(store.remaining_by_tenant, store.remaining_requests_by_tenant)
        return store
    # imported only here: it imports redis-py (~50 ms), which a guard without Redis never needs
    from guard.budget.fallback import FallbackStore

    return FallbackStore(config.redis_url, config.budget_limits, config.budget, clock, metrics)
