"""Per-tenant budgets (tokens per minute, requests per minute, in-flight slots).

:mod:`guard.budget.store` holds the contract every store implements. The stores:
:class:`MemoryStore` (one process), :class:`RedisStore` (shared by guards; one Lua script per
operation) and :class:`FallbackStore` (Redis with a breaker and a local share). A guard builds
the one its configuration asks for with :func:`build_budget_store`.
"""

from guard.budget.config import BudgetConfig
from guard.budget.factory import build_budget_store
from guard.budget.memory_store import MemoryStore
from guard.budget.store import BudgetLimits, BudgetStore, Denied, Grant

__all__ = ["BudgetConfig", "BudgetLimits", "BudgetStore", "Denied", "Grant",
           "build_budget_store", "MemoryStore", "RedisStore", "FallbackStore"]

# The Redis stores import redis-py (~50 ms); importing the package (``guard.config`` does, for
# the ``[budget]`` table) must not cost a guard without Redis that: they load on first use.
_REDIS_STORES = {"RedisStore": "guard.budget.redis_store", "FallbackStore": "guard.budget.fallback"}


def __getattr__(name: str):
    if name in _REDIS_STORES:
        import importlib

        return getattr(importlib.import_module(_REDIS_STORES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
