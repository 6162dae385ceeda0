"""``ProxyConfig``: the standalone proxy's own settings, the ``[proxy]`` table of guard.toml.

    [proxy]
    upstream_client = "h1"         # HTTP/1.1 on raw asyncio protocols; or "aiohttp"
                                   # (kvguard bench proxy --stacks compares them)
    connect_timeout_s = 5.0        # TCP connect to a replica; past it: re-dispatch once, then 502
    read_timeout_s = 60.0          # silence from a replica (response head or next chunk): 504 /
                                   # an SSE error event
    eject_after_failures = 3       # consecutive connect errors / timeouts / 5xx that eject one
    probe_interval_s = 1.0         # how often an ejected replica's /health is probed
    drain_timeout_s = 30.0         # SIGTERM: how long in-flight requests may still run (then cut)
    max_connections_per_replica = 256  # open connections to one replica (more requests wait
                                   # for one); below an engine's per-client connection cap
    forward_client_authorization = false  # the client's Authorization (its tenant key) goes
                                   # upstream only when true; a replica's own api_key wins
    relayed_paths = ["/tokenize", "/detokenize", "/version", "/ping", "/v1/models/*"]
                                   # relayed to a replica unpriced but counted (fnmatch)
    replicas_from = "file:/etc/kvguard/replicas.toml"  # or "dns:NAME:PORT", or
                                   # "inferencepool:[NAMESPACE/]POOL": the replicas are
                                   # listed there, re-read while running (instead of
                                   # [[replicas]]; guard.replicas.discovery)
    replicas_from_interval_s = 1.0 # how often that list is read again
    shared_polling_ttl_s = 2.0     # with redis_url: the proxies in front of the fleet share
                                   # its polling, each polls its shard and publishes it
                                   # (guard.replicas.shared_polling); unset: each polls all
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving.checks import require_count, require_seconds

__all__ = ["DEFAULT_RELAYED_PATHS", "ProxyConfig"]

# vLLM's cheap routes: relayed to a replica unpriced (guard.proxy.passthrough)
DEFAULT_RELAYED_PATHS = ("/tokenize", "/detokenize", "/version", "/ping", "/v1/models/*")

_CLIENTS = ("h1", "aiohttp")


@dataclass(frozen=True)
class ProxyConfig:
    upstream_client: str = "h1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    eject_after_failures: int = 3
    probe_interval_s: float = 1.0
    drain_timeout_s: float = 30.0
    max_connections_per_replica: int = 256
    forward_client_authorization: bool = False
    relayed_paths: tuple[str, ...] = DEFAULT_RELAYED_PATHS
    replicas_from: str | None = None
    replicas_from_interval_s: float = 1.0
    shared_polling_ttl_s: float | None = None

    def __post_init__(self) -> None:
        paths = self.relayed_paths
        if isinstance(paths, str) or not isinstance(paths, (tuple, list)) or not all(
                isinstance(p, str) and p.startswith("/") for p in paths):
            raise ValueError("proxy.relayed_paths: must be an array of path patterns starting "
                             f"with /, got {paths!r}")
        object.__setattr__(self, "relayed_paths", tuple(paths))
        if not isinstance(self.forward_client_authorization, bool):
            raise ValueError("proxy.forward_client_authorization: must be true or false, got "
                             f"{self.forward_client_authorization!r}")
        if self.upstream_client not in _CLIENTS:
            raise ValueError(f"proxy.upstream_client: must be one of {_CLIENTS}, "
                             f"got {self.upstream_client!r}")
        if self.replicas_from is not None:
            from guard.replicas.discovery import check_replicas_from

            check_replicas_from(self.replicas_from)
        for name in ("connect_timeout_s", "read_timeout_s", "probe_interval_s",
                     "drain_timeout_s", "replicas_from_interval_s"):
            require_seconds(f"proxy.{name}", getattr(self, name))
        if self.shared_polling_ttl_s is not None:
            require_seconds("proxy.shared_polling_ttl_s", self.shared_polling_ttl_s)
        for name in ("eject_after_failures", "max_connections_per_replica"):
            require_count(f"proxy.{name}", getattr(self, name))

    @classmethod
    def from_dict(cls, data: Any) -> ProxyConfig:
        """From the ``[proxy]`` table; unknown keys and wrong types raise ValueError."""
        if not isinstance(data, Mapping):
            raise ValueError("proxy: must be a table")
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"proxy.{unknown[0]}: unknown key")
        values = {}
        for name, value in data.items():
            if known[name] in ("float", "float | None") and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[name] = value
        return cls(**values)
