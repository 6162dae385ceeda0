"""``OperationalAccess``: who may read the guard's operational endpoints.

``/kvguard/state`` (tenant names, request ids), ``/kvguard/metrics`` and ``/metrics`` (per-tenant
series) need the admin key (``Authorization: Bearer <admin key>``; configured as
``admin_api_key`` or ``admin_key_sha256``, env ``KVGUARD_ADMIN_API_KEY``); ``/v1/models`` needs
the admin key or any tenant's key. ``/health`` stays open for load balancers and orchestrators.
The gate is on when ``protect_operational_endpoints`` says so, and by default whenever anonymous
requests are refused (``allow_anonymous = false`` with tenants configured). With it on and no
admin key configured, the admin endpoints answer nobody. No key or an unknown key: 401
``invalid_api_key``; a tenant's key on an admin endpoint: 403 ``admin_key_required``.
"""

from __future__ import annotations

from collections.abc import Mapping

from guard.admission.shedding import Rejection
from guard.config import GuardConfig

__all__ = ["ADMIN_PATHS", "MODELS_PATH", "OperationalAccess", "bearer_key"]

ADMIN_PATHS = frozenset({"/kvguard/state", "/kvguard/metrics", "/metrics"})
MODELS_PATH = "/v1/models"


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, else None."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


class OperationalAccess:
    """``check(path, headers)``: None when the request may go on, else the Rejection to send."""

    def __init__(self, config: GuardConfig) -> None:
        self.enabled = config.protects_operational_endpoints
        self._config = config

    def check(self, path: str, headers: Mapping[str, str]) -> Rejection | None:
        """``headers`` with lower-case names."""
        if not self.enabled or (path not in ADMIN_PATHS and path != MODELS_PATH):
            return None
        key = bearer_key(headers.get("authorization"))
        if self._config.is_admin_key(key):
            return None
        is_tenant = key is not None and self._config.match_tenant(key) is not None
        if path == MODELS_PATH and is_tenant:
            return None
        if not is_tenant:
            return Rejection(401, "invalid_api_key", f"{path} needs an API key: send "
                             "'Authorization: Bearer <key>'")
        return Rejection(403, "admin_key_required",
                         f"{path} is an operational endpoint: it needs the admin key")
