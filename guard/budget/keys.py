"""Redis key names: ``kvguard:{tenant}:...`` with the tenant as the Cluster hash tag.

A tenant name made only of ``[A-Za-z0-9_.-]`` is used as is; any other name (one with braces,
colons, spaces, non-ASCII) is hex-encoded with an ``x-`` prefix, so a name can never break the
hash tag or collide with another tenant's keys.
"""

from __future__ import annotations

import string

__all__ = ["tenant_keys", "tenant_tag", "EPOCH_KEY", "LIVE_GUARDS_KEY", "PREFIX"]

PREFIX = "kvguard"
LIVE_GUARDS_KEY = f"{PREFIX}:{{guards}}:live"
EPOCH_KEY = f"{PREFIX}:{{guards}}:epoch"  # same slot: one heartbeat script writes both
_SAFE = frozenset(string.ascii_letters + string.digits + "_.-")


def tenant_tag(tenant: str) -> str:
    if tenant and not tenant.startswith("x-") and all(c in _SAFE for c in tenant):
        return tenant
    return "x-" + tenant.encode("utf-8").hex()


def tenant_keys(tenant: str) -> list[str]:
    """The tenant's bucket hash, lease zset and grant hash (one Cluster slot)."""
    base = f"{PREFIX}:{{{tenant_tag(tenant)}}}"
    return [f"{base}:bucket", f"{base}:leases", f"{base}:grants"]
