"""``RetryBudgets``: one retry budget per model, so a retry storm on one model never spends
another's.

A request's scope is the set of replicas its ``model`` routes to
(:attr:`policies.cost.RequestCost.replica_ids`; None for a request that names no model or a
guard without model routing: the whole fleet). Each scope has its own
:class:`policies.retry_budget.RetryBudget` (per tenant and scope-wide windows): retries of
model A are counted against A's first attempts and A's advised retries only. Aliases of one
model, or two models on the same replicas, share a scope, as they share the capacity that a
retry storm exhausts. The scopes are the catalog's replica groups: few, and bounded by it.
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.retry_budget import GLOBAL, RetryBudget, RetryBudgetConfig

__all__ = ["RetryBudgets"]


class RetryBudgets:
    """Retry budgets by scope (the replica ids a request may go to; None: every replica)."""

    def __init__(self, config: RetryBudgetConfig) -> None:
        self.config = config
        self._budgets: dict[frozenset[str] | None, RetryBudget] = {}

    def of(self, cost: RequestCost) -> RetryBudget:
        """The budget ``cost`` is counted against (made on first use)."""
        scope = cost.replica_ids
        budget = self._budgets.get(scope)
        if budget is None:
            budget = self._budgets[scope] = RetryBudget(self.config)
        return budget

    def counts(self, now_s: float) -> tuple[int, int, int]:
        """``(first attempts, retries, advised retries)`` over every scope's window: the
        guard-wide totals it exports."""
        totals = [0, 0, 0]
        for budget in self._budgets.values():
            for i, count in enumerate(budget.counts(GLOBAL, now_s)):
                totals[i] += count
        return totals[0], totals[1], totals[2]
