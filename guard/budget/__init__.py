"""Per-tenant budgets (tokens per minute, requests per minute, in-flight slots).

:mod:`guard.budget.store` holds the contract every store implements. The stores:
:class:`MemoryStore` (one process), :class:`RedisStore` (shared by guards; one Lua script per
operation) and :class:`FallbackStore` (Redis with a breaker and a local share). A guard builds
the one its configuration asks for with :func:`build_budget_store`.
"""

from guard.budget.config import BudgetConfig
from guard.budget.factory import build_budget_store
from guard.budget.fallback import FallbackStore
from guard.budget.memory_store import MemoryStore
from guard.budget.redis_store import RedisStore
from guard.budget.store import BudgetLimits, BudgetStore, Denied, Grant

__all__ = ["BudgetConfig", "BudgetLimits", "BudgetStore", "Denied", "Grant",
           "build_budget_store", "MemoryStore", "RedisStore", "FallbackStore"]
