"""Per-tenant budgets (tokens per minute, requests per minute, in-flight slots).

:mod:`guard.budget.store` holds the contract every store implements; the stores themselves
(in-memory, Redis) live beside it.
"""

from guard.budget.store import BudgetLimits, BudgetStore, Denied, Grant

__all__ = ["BudgetLimits", "BudgetStore", "Denied", "Grant"]
