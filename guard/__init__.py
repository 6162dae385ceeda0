"""kvguard's guard: admission control in front of LLM replicas (never imports torch or engine).

The public names are imported lazily on first use, so ``import guard`` (and the ``kvguard``
console script, which lives in ``guard.cli``) stays cheap::

    from guard import AdmissionMiddleware, load_config
    app.add_middleware(AdmissionMiddleware, config=load_config("guard.toml"))
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AdmissionController",
    "AdmissionMiddleware",
    "AdmissionQueue",
    "AdmissionRequest",
    "Admitted",
    "GuardConfig",
    "GuardMetrics",
    "LoadState",
    "Pricer",
    "PricingError",
    "Rejection",
    "ReplicaConfig",
    "RetryAdvisor",
    "TenantConfig",
    "Ticket",
    "TicketBook",
    "TraceWriter",
    "Wait",
    "load_config",
]

_HOMES = {
    "AdmissionController": "guard.controller",
    "AdmissionMiddleware": "guard.middleware",
    "AdmissionQueue": "guard.admission.queue",
    "AdmissionRequest": "guard.admission.request",
    "Admitted": "guard.admission.admitted",
    "GuardConfig": "guard.config",
    "GuardMetrics": "guard.observe.metrics",
    "LoadState": "guard.replicas.load_state",
    "Pricer": "guard.request.pricing",
    "PricingError": "guard.errors",
    "Rejection": "guard.admission.shedding",
    "ReplicaConfig": "guard.config",
    "RetryAdvisor": "guard.admission.shedding",
    "TenantConfig": "guard.config",
    "Ticket": "guard.admission.ticket",
    "TicketBook": "guard.admission.ticket",
    "TraceWriter": "guard.observe.trace",
    "Wait": "guard.admission.wait",
    "load_config": "guard.config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'guard' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
