"""``cache_salt``: the request field (vLLM's) that partitions an engine's prefix cache.

Two requests share cached blocks only when their salts are equal. With
``prefix_cache_isolation = "tenant"`` the guard salts every request with a keyed hash of its
tenant: HMAC-SHA256 under a secret only the guard holds (``prefix_cache_secret``, or a random
one per guard process), so no client can compute another tenant's salt, and one tenant's
cached prompts never speed up (and so never reveal themselves to) another's. A client may still
send its own salt to partition its tenant's cache further: the guard folds it into the
tenant's. With ``"shared"`` (the default) a client's salt goes upstream as sent.

A ``cache_salt`` that is not a non-empty string is refused with 400 in either mode (the engine
would refuse it too).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from guard.errors import PricingError

__all__ = ["ISOLATIONS", "CacheSalter"]

ISOLATIONS = ("shared", "tenant")


class CacheSalter:
    """The salt each request is forwarded with."""

    def __init__(self, isolation: str = "shared", secret: bytes | None = None) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"prefix_cache_isolation: must be one of {ISOLATIONS}, "
                             f"got {isolation!r}")
        self.isolation = isolation
        self._secret = secret if secret else os.urandom(32)

    def salts(self, body: dict, tenant: str) -> tuple[str | None, str | None]:
        """(the salt the engine will see, the salt the guard must add to the body: None when
        the body goes as sent). PricingError 400 for a client salt that is not a string."""
        client = body.get("cache_salt")
        if client is not None and (not isinstance(client, str) or not client):
            raise PricingError(400, "invalid_type", "'cache_salt' must be a non-empty string",
                               "cache_salt")
        if self.isolation == "shared":
            return client, None
        message = tenant.encode() + b"\0" + (client.encode() if client is not None else b"")
        salt = hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]
        return salt, salt
