"""The guard's configuration: frozen dataclasses, a TOML loader and ``KVGUARD_*`` env overrides.

Only :func:`load_config` reads files and the environment; everything else receives a validated
:class:`GuardConfig` (or the part of it it needs).

TOML layout (see ``docs/guard-config.example.toml``)::

    policy = "slo"
    max_body_bytes = 1048576
    admin_api_key = "..."      # /kvguard/state, /kvguard/metrics, /metrics (or admin_key_sha256)
    prefix_cache = "approximate"   # "off" | "approximate" | "precise" (needs tokenizer)
    prefix_cache_isolation = "shared"  # "tenant": a per-tenant cache_salt (prefix_cache_secret)
    chat_template = "tokenizer_config.json"  # precise: chat priced with the replicas' template
    [policy_params]            # passed to the policy as-is
    [classes.interactive]      # merged over the built-in class of the same name
    ttft_s = 1.0
    itl_s = 0.08
    [[tenants]]
    name = "acme"
    key_sha256 = "<hex sha256 of the API key>"   # or api_key = "..." (hashed at load)
    [[replicas]]
    replica_id = "r0"
    url = "http://127.0.0.1:8001"
    state_source = "kvguard"   # "kvguard" | "vllm" | "sglang" | "tgi" | "llamacpp" | "auto" | "none" | "asgi"
    weight = 1.0               # relative share where routing is least-loaded (ReplicaConfig)
    kv_events_endpoint = "tcp://10.0.0.5:5557"  # its KV-cache events (prefix_cache = "precise")
    [proxy]                    # the standalone proxy's settings (guard.proxy.config)
    [cost]                     # prices for cost accounting (guard.observe.cost_config)

Environment: ``KVGUARD_CONFIG`` names the TOML file; ``KVGUARD_<FIELD>`` overrides any scalar
field (``KVGUARD_POLICY=cap``, ``KVGUARD_MAX_BODY_BYTES=65536``, ``KVGUARD_TRACE_PATH=...``);
``KVGUARD_UPSTREAMS`` (comma-separated URLs) replaces the replicas, whose state source is
``KVGUARD_UPSTREAM_STATE_SOURCE`` (default ``kvguard``); ``KVGUARD_POLICY_PARAMS`` is a JSON
object; ``KVGUARD_ADMIN_API_KEY`` is the admin key in clear (hashed at load). An unknown
``KVGUARD_*`` variable (a typo) is refused with its name.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import hashlib
import hmac
import json
import math
import os
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from guard.budget.config import LIMIT_KEYS, BudgetConfig
from guard.budget.store import BudgetLimits
from guard.observe.cost_config import CostConfig
from guard.proxy.config import ProxyConfig
from guard.redact import redact_url, redact_value
from policies.cost import RequestClass
from policies.retry_budget import RetryBudgetConfig

PREFIX_CACHE_MODES = ("off", "approximate", "precise")

__all__ = [
    "PREFIX_CACHE_MODES",
    "GuardConfig",
    "TenantConfig",
    "ReplicaConfig",
    "ANONYMOUS_TENANT",
    "DEFAULT_CLASSES",
    "STATE_SOURCES",
    "config_with_upstreams",
    "replica_from",
    "with_replica_keys",
    "hash_api_key",
    "load_config",
]

ANONYMOUS_TENANT = "anonymous"
STATE_SOURCES = ("kvguard", "stream", "vllm", "sglang", "tgi", "llamacpp", "auto", "none",
                 "asgi")
MISSING_MAX_TOKENS = ("fill", "forward")  # GuardConfig.missing_max_tokens
# glob patterns (fnmatch) of the POST paths the guard admits; the rest pass straight through
DEFAULT_ADMITTED_PATHS = ("*/v1/completions", "*/v1/chat/completions", "*/v1/responses",
                          "*/v1/embeddings")
PRICED_SUFFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
DEFAULT_CLASSES = (
    RequestClass("interactive", ttft_s=1.0, itl_s=0.080, priority=0),
    RequestClass("batch", ttft_s=30.0, itl_s=1.0, priority=2),
)


def hash_api_key(api_key: str) -> str:
    """The sha256 hex digest under which an API key is stored."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class TenantConfig:
    """One tenant. ``default_class`` None means the guard's ``default_class``."""

    name: str
    key_sha256: str
    default_class: str | None = None
    may_choose_class: bool = False
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenants.name: must be a non-empty string")
        if not isinstance(self.key_sha256, str) or not _is_sha256_hex(self.key_sha256.lower()):
            raise ValueError(f"tenants[{self.name!r}].key_sha256: must be 64 hex characters")
        object.__setattr__(self, "key_sha256", self.key_sha256.lower())
        try:
            self.own_limits  # noqa: B018 - validates the budget axes
        except ValueError as exc:
            raise ValueError(f"tenants[{self.name!r}].{str(exc).removeprefix('budget ')}") from None

    @property
    def own_limits(self) -> BudgetLimits:
        """This tenant's own budget limits (unset axes fall back to ``[budget]``)."""
        return BudgetLimits(self.tokens_per_minute, self.requests_per_minute, self.max_concurrent)


@dataclass(frozen=True)
class ReplicaConfig:
    """One upstream replica. ``url`` None means the wrapped ASGI app itself (in-process).

    ``state_source``: ``kvguard`` (``GET /kvguard/state``), ``stream`` (a kvguard replica's
    ``GET /kvguard/state/stream``: a full document, then deltas), ``vllm``, ``sglang``, ``tgi`` or
    ``llamacpp`` (that engine's ``GET /metrics``), ``auto`` (probe ``/kvguard/state``, then the
    known ``/metrics`` formats, else learn), ``none`` (no load state is read: a replica of
    unknown capacity, admitted to by its learned concurrency limit) or ``asgi`` (the wrapped
    app).

    ``max_model_len`` is only needed for metrics replicas (their metrics do not carry it);
    without it the guard leaves context-length checks to the upstream.

    ``weight`` (a finite number > 0, default 1; only ratios between replicas matter) is the
    replica's relative share of traffic where the policy cannot tell replicas apart by their
    state: least-loaded routing (every baseline, and ``slo`` without fresh state, e.g.
    ``state_source = "none"``) compares requests ÷ weight, and ``slo`` breaks exact ties of its
    TTFT forecast that way. A fresh forecast is not bent by it: it already prices each
    replica's own load.

    ``api_key`` (or ``api_key_env``, the name of an environment variable that
    :func:`load_config` reads it from): the proxy's own credential for this replica, sent as
    ``Authorization: Bearer ...``; the client's key (its tenant key) never goes upstream unless
    ``[proxy] forward_client_authorization`` says so.

    ``models``: every name a request's ``model`` may carry to be routed here (several names
    for one model are aliases; the request is forwarded with the name it sent). Empty: the
    proxy reads them from the replica's ``GET /v1/models``, polled with its state.
    """

    replica_id: str
    url: str | None = None
    state_source: str = "kvguard"
    max_model_len: int | None = None
    weight: float = 1.0
    kv_events_endpoint: str | None = None  # ZMQ endpoint of its KV-cache events (precise view)
    models: tuple[str, ...] = ()  # the model names it serves (aliases too); () = its /v1/models
    # the key the proxy sends this replica as "Authorization: Bearer ..." (never shown)
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None  # the environment variable load_config reads api_key from

    def __post_init__(self) -> None:
        if self.kv_events_endpoint is not None and not str(self.kv_events_endpoint).startswith(
                ("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"replicas[{self.replica_id!r}].kv_events_endpoint: must be a ZMQ "
                             f"endpoint (tcp://host:port or ipc://path), "
                             f"got {self.kv_events_endpoint!r}")
        if not self.replica_id:
            raise ValueError("replicas.replica_id: must be a non-empty string")
        if self.state_source not in STATE_SOURCES:
            raise ValueError(
                f"replicas[{self.replica_id!r}].state_source: must be one of {STATE_SOURCES}, "
                f"got {self.state_source!r}"
            )
        if self.url is None and self.state_source != "asgi":
            raise ValueError(f"replicas[{self.replica_id!r}].url: required unless state_source is 'asgi'")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int)
            or self.max_model_len < 1
        ):
            raise ValueError(f"replicas[{self.replica_id!r}].max_model_len: must be an integer >= 1")
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or not weight > 0:
            raise ValueError(f"replicas[{self.replica_id!r}].weight: must be a finite number > 0, "
                             f"got {weight!r}")
        object.__setattr__(self, "weight", float(weight))
        models = self.models
        if isinstance(models, str) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"replicas[{self.replica_id!r}].models: must be an array of "
                             f"non-empty model names, got {models!r}")
        object.__setattr__(self, "models", tuple(models))
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError(f"replicas[{self.replica_id!r}]: give api_key or api_key_env, "
                             "not both")
        for name in ("api_key", "api_key_env"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value
                                      or not value.isprintable() or " " in value):
                raise ValueError(f"replicas[{self.replica_id!r}].{name}: must be a non-empty "
                                 "string without spaces")
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"replicas[{self.replica_id!r}].url: must start with http:// or https://")
            object.__setattr__(self, "url", self.url.rstrip("/"))


def _positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class GuardConfig:
    """Everything the guard needs. Build with :meth:`from_dict` or :func:`load_config`."""

    classes: tuple[RequestClass, ...] = DEFAULT_CLASSES
    default_class: str = "interactive"
    tenants: tuple[TenantConfig, ...] = ()
    allow_anonymous: bool = True
    anonymous_may_choose_class: bool = False
    policy: str = "slo"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    # a request without max_tokens: "fill" (priced at default_max_tokens, forwarded with it,
    # the response says so in x-kvguard-max-tokens) or "forward" (sent untouched; priced by
    # the learned output length, its reservation bounded by the context)
    missing_max_tokens: str = "fill"
    max_queue_len: int = 512
    max_queue_wait_s: float = 30.0
    refresh_interval_s: float = 0.1
    max_staleness_s: float = 2.0
    state_timeout_s: float = 1.0
    unhealthy_after_errors: int = 3
    replicas: tuple[ReplicaConfig, ...] = ()
    tokenizer: str | None = None  # a tokenizer.json path (guard.request.pricing.tokenizer_counter)
    # the replicas' prefix caches (guard.replicas.prefix_cache): "off" | "approximate" | "precise"
    prefix_cache: str = "approximate"
    prefix_cache_chunk_chars: int = 256  # approximate view: characters per hashed chunk
    prefix_cache_max_blocks: int = 1 << 18  # tracked blocks per replica, at most (~130 B each;
    # ~280 B for a replica whose vLLM events are translated: guard.replicas.kv_event_translation)
    prefix_cache_max_sessions: int = 100_000  # x-session-id pins remembered, at most
    # "shared" | "tenant" (guard.request.cache_salt): a per-tenant cache_salt, keyed by the secret
    prefix_cache_isolation: str = "shared"
    prefix_cache_secret: str | None = field(default=None, repr=False)  # None: random per process
    # the replicas' chat template (guard.request.chat_template): a tokenizer_config.json or a
    # raw jinja file; the precise view renders chat requests with it (read and compiled here)
    chat_template: str | None = None
    initial_chars_per_token: float = 4.0
    retry_budget_ratio: float = 0.10  # retries allowed per first attempt while shedding
    retry_budget_window_s: float = 10.0
    retry_budget_min_retries: int = 3
    idempotency_ttl_s: float = 600.0
    max_idempotency_bytes: int = 16 << 20  # hashed keys, ~200 B each: ~84,000 keys
    trace_path: str | None = None
    max_tenant_labels: int = 20
    redis_url: str | None = None
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    class_header: str = "x-kvguard-class"
    deadline_header: str = "x-kvguard-deadline-ms"
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    admin_key_sha256: str | None = None  # or admin_api_key = "..." (hashed at load)
    protect_operational_endpoints: bool | None = None  # None: on when anonymous is refused
    admitted_paths: tuple[str, ...] = DEFAULT_ADMITTED_PATHS
    _classes_by_name: Mapping[str, RequestClass] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    _path_patterns: tuple = field(init=False, repr=False, compare=False, default=())
    _chat_template: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        self._check_classes()
        self._check_tenants()
        self._check_admin()
        self._check_numbers()
        self._check_missing_max_tokens()
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError("policy: must be a non-empty string")
        object.__setattr__(self, "policy_params", types.MappingProxyType(dict(self.policy_params)))
        if self.redis_url is not None and not str(self.redis_url).startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: must start with redis://, rediss:// or unix://, "
                             f"got {redact_url(self.redis_url)!r}")
        ids = [r.replica_id for r in self.replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replicas: duplicate replica_id in {ids}")
        self._check_paths()
        self._check_prefix_cache()
        for name in ("class_header", "deadline_header"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or value != value.strip():
                raise ValueError(f"{name}: must be a non-empty header name")
            object.__setattr__(self, name, value.lower())

    def _check_prefix_cache(self) -> None:
        if self.prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"prefix_cache: must be one of {PREFIX_CACHE_MODES}, "
                             f"got {self.prefix_cache!r}")
        if self.prefix_cache == "precise" and self.tokenizer is None:
            raise ValueError("prefix_cache: 'precise' needs the engine's tokenizer "
                             "(set the tokenizer key to its tokenizer.json)")
        if self.prefix_cache_isolation not in ("shared", "tenant"):
            raise ValueError(f"prefix_cache_isolation: must be 'shared' or 'tenant', "
                             f"got {self.prefix_cache_isolation!r}")
        for name in ("prefix_cache_chunk_chars", "prefix_cache_max_blocks",
                     "prefix_cache_max_sessions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.prefix_cache_secret is not None and len(self.prefix_cache_secret) < 16:
            raise ValueError("prefix_cache_secret: must be at least 16 characters")
        if self.chat_template is not None:
            if self.prefix_cache != "precise":
                raise ValueError("chat_template: only the precise prefix view renders chat "
                                 "requests with it (set prefix_cache = 'precise')")
            from guard.request.chat_template import load_chat_template

            object.__setattr__(self, "_chat_template", load_chat_template(self.chat_template))

    @property
    def loaded_chat_template(self) -> Any:
        """The ``chat_template`` file as read and compiled at construction (None: no key)."""
        return self._chat_template

    def _check_paths(self) -> None:
        paths = self.admitted_paths
        if isinstance(paths, str) or not isinstance(paths, (tuple, list)) or not paths:
            raise ValueError("admitted_paths: must be a non-empty array of path patterns")
        for pattern in paths:
            if not isinstance(pattern, str) or not pattern.startswith(("/", "*")):
                raise ValueError(f"admitted_paths: {pattern!r} must be a path pattern "
                                 "starting with / or *")
            if not pattern.endswith(PRICED_SUFFIXES):
                raise ValueError(f"admitted_paths: {pattern!r} must end in one of "
                                 f"{', '.join(PRICED_SUFFIXES)} (the bodies the guard prices)")
        object.__setattr__(self, "admitted_paths", tuple(paths))
        literal = [p for p in paths if not any(c in p for c in "*?[")]
        suffixes = tuple(p[1:] for p in paths if p.startswith("*") and not any(
            c in p[1:] for c in "*?["))
        patterns = tuple(re.compile(fnmatch.translate(p)) for p in paths
                         if p not in literal and p[1:] not in suffixes)
        object.__setattr__(self, "_path_patterns", (frozenset(literal), suffixes, patterns))

    def is_admitted_path(self, path: str) -> bool:
        """True when a POST to ``path`` goes through admission (``admitted_paths``)."""
        exact, suffixes, patterns = self._path_patterns
        if path in exact or path.endswith(suffixes):
            return True
        for pattern in patterns:
            if pattern.match(path):
                return True
        return False

    def _check_classes(self) -> None:
        by_name = {c.name: c for c in self.classes}
        if not by_name:
            raise ValueError("classes: at least one request class is required")
        if len(by_name) != len(self.classes):
            raise ValueError("classes: duplicate class name")
        if self.default_class not in by_name:
            raise ValueError(f"default_class: {self.default_class!r} is not a configured class")
        object.__setattr__(self, "_classes_by_name", types.MappingProxyType(by_name))

    def _check_admin(self) -> None:
        digest = self.admin_key_sha256
        if digest is None:
            return
        if not (isinstance(digest, str) and len(digest) == 64
                and all(c in "0123456789abcdef" for c in digest)):
            raise ValueError("admin_key_sha256: must be 64 lower-case hex digits")
        if any(t.key_sha256 == digest for t in self.tenants):
            raise ValueError("admin_api_key: must differ from every tenant's API key")

    @property
    def protects_operational_endpoints(self) -> bool:
        """Whether ``/kvguard/state``, ``/kvguard/metrics``, ``/metrics`` need the admin key and
        ``/v1/models`` a known key: as configured, else whenever anonymous requests are
        refused (``allow_anonymous = false`` with tenants configured)."""
        if self.protect_operational_endpoints is not None:
            return self.protect_operational_endpoints
        return self.resolve_tenant(None) is None

    def is_admin_key(self, api_key: str | None) -> bool:
        """Whether ``api_key`` is the configured admin key (constant-time comparison)."""
        if not api_key or self.admin_key_sha256 is None:
            return False
        return hmac.compare_digest(hash_api_key(api_key), self.admin_key_sha256)

    def _check_tenants(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names) or ANONYMOUS_TENANT in names:
            raise ValueError(f"tenants: names must be unique and not {ANONYMOUS_TENANT!r}")
        keys = [t.key_sha256 for t in self.tenants]
        if len(set(keys)) != len(keys):
            raise ValueError("tenants: two tenants share one API key")
        for t in self.tenants:
            if t.default_class is not None and t.default_class not in self._classes_by_name:
                raise ValueError(f"tenants[{t.name!r}].default_class: unknown class {t.default_class!r}")

    def _check_missing_max_tokens(self) -> None:
        if self.missing_max_tokens not in MISSING_MAX_TOKENS:
            raise ValueError(f"missing_max_tokens: must be one of {MISSING_MAX_TOKENS}, got "
                             f"{self.missing_max_tokens!r}")

    def _check_numbers(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens",
                     "max_queue_len", "unhealthy_after_errors", "max_idempotency_bytes",
                     "max_tenant_labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.max_idempotency_bytes < 200:
            raise ValueError("max_idempotency_bytes: must be >= 200 (one hashed key), got "
                             f"{self.max_idempotency_bytes!r}")
        for name in ("max_queue_wait_s", "refresh_interval_s", "max_staleness_s",
                     "state_timeout_s", "idempotency_ttl_s"):
            _positive(name, getattr(self, name))
        _positive("initial_chars_per_token", self.initial_chars_per_token)
        if not 1.0 <= self.initial_chars_per_token <= 8.0:
            raise ValueError("initial_chars_per_token: must be within [1, 8]")
        ratio = self.retry_budget_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"retry_budget_ratio: must be within [0, 1], got {ratio!r}")
        _positive("retry_budget_window_s", self.retry_budget_window_s)
        count = self.retry_budget_min_retries
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"retry_budget_min_retries: must be an integer >= 0, got {count!r}")

    @property
    def retry_budget(self) -> RetryBudgetConfig:
        """The retry budget's own config (:mod:`policies.retry_budget`)."""
        return RetryBudgetConfig(float(self.retry_budget_ratio), float(self.retry_budget_window_s),
                                 self.retry_budget_min_retries)

    # --- lookups used on the request path -------------------------------------------------

    def request_class(self, name: str) -> RequestClass | None:
        """The class called ``name``, or None when no such class is configured."""
        return self._classes_by_name.get(name)

    @property
    def in_process(self) -> bool:
        """True when no replicas are configured: the wrapped ASGI app is the one replica."""
        return not self.replicas

    def match_tenant(self, api_key: str | None) -> TenantConfig | None:
        """The tenant whose key is ``api_key``, comparing every tenant in constant time."""
        if not api_key:
            return None
        digest = hash_api_key(api_key)
        found = None
        for tenant in self.tenants:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        return found

    def resolve_tenant(self, api_key: str | None) -> TenantConfig | None:
        """The tenant for a request, the anonymous tenant, or None (answer 401).

        Anonymous is allowed when no tenants are configured or ``allow_anonymous`` is set.
        """
        tenant = self.match_tenant(api_key)
        if tenant is not None:
            return tenant
        if self.allow_anonymous or not self.tenants:
            return self.anonymous_tenant
        return None

    @functools.cached_property
    def anonymous_tenant(self) -> TenantConfig:
        """The tenant of requests without a known key (built once per config)."""
        return TenantConfig(
            name=ANONYMOUS_TENANT,
            key_sha256="0" * 64,
            default_class=self.default_class,
            may_choose_class=self.anonymous_may_choose_class,
        )

    def budget_limits(self, tenant_name: str) -> BudgetLimits:
        """The budget of ``tenant_name``: its own limits over the ``[budget]`` defaults."""
        limits = self._budget_limits.get(tenant_name)
        return self.budget.default_limits if limits is None else limits

    @functools.cached_property
    def _budget_limits(self) -> Mapping[str, BudgetLimits]:
        return types.MappingProxyType({t.name: self.budget.limits(t.own_limits) for t in self.tenants})

    @property
    def budgets_enabled(self) -> bool:
        """True when any tenant (or the default) has a budget limit."""
        return not (self.budget.default_limits.unlimited
                    and all(limits.unlimited for limits in self._budget_limits.values()))

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GuardConfig:
        """Build from a TOML-shaped mapping. Unknown keys raise ValueError naming the key."""
        data = dict(data)
        if "admin_api_key" in data:
            if "admin_key_sha256" in data:
                raise ValueError("admin_api_key: give admin_api_key or admin_key_sha256, not both")
            data["admin_key_sha256"] = hash_api_key(
                _check_type("admin_api_key", data.pop("admin_api_key"), str))
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown configuration key")
        if "classes" in data:
            data["classes"] = _classes_from(data["classes"])
        if "tenants" in data:
            data["tenants"] = tuple(_tenant_from(i, t) for i, t in enumerate(_list("tenants", data["tenants"])))
        if "replicas" in data:
            data["replicas"] = tuple(replica_from(i, r) for i, r in enumerate(_list("replicas", data["replicas"])))
        if "proxy" in data and not isinstance(data["proxy"], ProxyConfig):
            data["proxy"] = ProxyConfig.from_dict(data["proxy"])
        if "budget" in data:
            data["budget"] = BudgetConfig.from_dict(data["budget"])
        if "cost" in data and not isinstance(data["cost"], CostConfig):
            data["cost"] = CostConfig.from_dict(data["cost"])
        if "admitted_paths" in data:
            data["admitted_paths"] = tuple(_list("admitted_paths", data["admitted_paths"]))
        if "policy_params" in data and not isinstance(data["policy_params"], Mapping):
            raise ValueError("policy_params: must be a table")
        for name, (wanted, nullable) in _SCALAR_FIELDS.items():
            if name in data and not (nullable and data[name] is None):
                data[name] = _check_type(name, data[name], wanted)
        return cls(**data)


def _list(key: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key}: must be an array of tables")
    return list(value)


def _table(key: str, value: Any, allowed: set[str]) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: must be a table")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown key")
    return dict(value)


def _classes_from(value: Any) -> tuple[RequestClass, ...]:
    if not isinstance(value, Mapping):
        raise ValueError("classes: must be a table of class tables")
    merged = {c.name: c for c in DEFAULT_CLASSES}
    for name, table in value.items():
        key = f"classes.{name}"
        spec = _table(key, table, {"ttft_s", "itl_s", "priority"})
        base = merged.get(name)
        if base is None and not {"ttft_s", "itl_s"} <= set(spec):
            raise ValueError(f"{key}: a new class needs ttft_s and itl_s")
        fields = {"ttft_s": float, "itl_s": float, "priority": int}
        for fname, ftype in fields.items():
            if fname in spec:
                spec[fname] = _check_type(f"{key}.{fname}", spec[fname], ftype)
        try:
            merged[name] = dataclasses.replace(base, **spec) if base else RequestClass(name, **spec)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    return tuple(merged.values())


def _tenant_from(index: int, value: Any) -> TenantConfig:
    key = f"tenants[{index}]"
    spec = _table(key, value, {"name", "key_sha256", "api_key", "default_class",
                               "may_choose_class", *LIMIT_KEYS})
    if "api_key" in spec:
        if "key_sha256" in spec:
            raise ValueError(f"{key}.api_key: give api_key or key_sha256, not both")
        spec["key_sha256"] = hash_api_key(_check_type(f"{key}.api_key", spec.pop("api_key"), str))
    if "name" not in spec or "key_sha256" not in spec:
        raise ValueError(f"{key}: needs name and key_sha256 (or api_key)")
    types_ = {"name": str, "key_sha256": str, "default_class": str,
              "may_choose_class": bool, **dict.fromkeys(LIMIT_KEYS, int)}
    for fname, ftype in types_.items():
        if fname in spec:
            spec[fname] = _check_type(f"{key}.{fname}", spec[fname], ftype)
    return TenantConfig(**spec)


def replica_from(index: int, value: Any) -> ReplicaConfig:
    """One ``[[replicas]]`` table (``index``: its place, for the default id and errors)."""
    key = f"replicas[{index}]"
    wanted = {"replica_id": str, "url": str, "state_source": str, "max_model_len": int,
              "weight": float, "kv_events_endpoint": str,
              "models": list, "api_key": str, "api_key_env": str}
    spec = _table(key, value, set(wanted))
    spec.setdefault("replica_id", f"r{index}")
    for fname in spec:
        spec[fname] = _check_type(f"{key}.{fname}", spec[fname], wanted[fname])
    return ReplicaConfig(**spec)


def _check_type(key: str, value: Any, wanted: type) -> Any:
    """``value`` converted to ``wanted`` where lossless (int → float), else ValueError naming key."""
    if wanted is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if wanted is int and isinstance(value, bool):
        raise ValueError(f"{key}: expected an integer, got {redact_value(key, value)}")
    if not isinstance(value, wanted):
        raise ValueError(f"{key}: expected {wanted.__name__}, got {type(value).__name__} "
                         f"{redact_value(key, value)}")
    return value


# scalar fields: name -> (type, nullable). Used for type checks and env overrides.
_SCALAR_FIELDS: dict[str, tuple[type, bool]] = {
    "default_class": (str, False), "allow_anonymous": (bool, False),
    "anonymous_may_choose_class": (bool, False), "policy": (str, False),
    "max_body_bytes": (int, False), "default_max_tokens": (int, False),
    "missing_max_tokens": (str, False), "max_queue_len": (int, False),
    "max_queue_wait_s": (float, False), "refresh_interval_s": (float, False),
    "max_staleness_s": (float, False), "state_timeout_s": (float, False),
    "unhealthy_after_errors": (int, False), "tokenizer": (str, True),
    "initial_chars_per_token": (float, False), "retry_budget_ratio": (float, False),
    "retry_budget_window_s": (float, False), "retry_budget_min_retries": (int, False),
    "idempotency_ttl_s": (float, False), "max_idempotency_bytes": (int, False),
    "trace_path": (str, True), "max_tenant_labels": (int, False), "redis_url": (str, True),
    "class_header": (str, False), "deadline_header": (str, False),
    "admin_key_sha256": (str, True), "protect_operational_endpoints": (bool, True),
    "prefix_cache": (str, False), "prefix_cache_chunk_chars": (int, False),
    "prefix_cache_max_blocks": (int, False), "prefix_cache_max_sessions": (int, False),
    "prefix_cache_isolation": (str, False), "prefix_cache_secret": (str, True),
    "chat_template": (str, True),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_env(var: str, text: str, wanted: type, nullable: bool) -> Any:
    if nullable and text.strip().lower() in {"", "none", "null"}:
        return None
    try:
        if wanted is bool:
            low = text.strip().lower()
            if low not in _TRUE | _FALSE:
                raise ValueError
            return low in _TRUE
        return wanted(text.strip()) if wanted is not str else text
    except ValueError:
        raise ValueError(f"{var}: expected {wanted.__name__}, got {text!r}") from None


# Variables read here besides ``KVGUARD_<FIELD>``; ``KVGUARD_ABLATE`` belongs to the
# measurement script scripts/guard_instructions.py, whose children load this config.
_OTHER_ENV = ("KVGUARD_CONFIG", "KVGUARD_ADMIN_API_KEY", "KVGUARD_POLICY_PARAMS",
              "KVGUARD_UPSTREAMS", "KVGUARD_UPSTREAM_STATE_SOURCE", "KVGUARD_ABLATE",
              "KVGUARD_K8S_SERVICEACCOUNT_DIR")  # guard.replicas.inference_pool


def _check_env_names(env: Mapping[str, str]) -> None:
    """A mistyped ``KVGUARD_*`` variable refuses start-up instead of being silently ignored."""
    known = {"KVGUARD_" + name.upper() for name in _SCALAR_FIELDS} | set(_OTHER_ENV)
    for var in sorted(env):
        if var.startswith("KVGUARD_") and var not in known:
            close = difflib.get_close_matches(var, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{var}: unknown kvguard environment variable{hint}")


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    _check_env_names(env)
    out: dict[str, Any] = {}
    for name, (wanted, nullable) in _SCALAR_FIELDS.items():
        var = "KVGUARD_" + name.upper()
        if var in env:
            out[name] = _parse_env(var, env[var], wanted, nullable)
    if "KVGUARD_ADMIN_API_KEY" in env:  # the plain key, hashed here like the TOML's
        out["admin_key_sha256"] = hash_api_key(env["KVGUARD_ADMIN_API_KEY"])
    if "KVGUARD_POLICY_PARAMS" in env:
        try:
            params = json.loads(env["KVGUARD_POLICY_PARAMS"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"KVGUARD_POLICY_PARAMS: invalid JSON ({exc.msg})") from None
        if not isinstance(params, dict):
            raise ValueError("KVGUARD_POLICY_PARAMS: must be a JSON object")
        out["policy_params"] = params
    if "KVGUARD_UPSTREAMS" in env:
        source = env.get("KVGUARD_UPSTREAM_STATE_SOURCE", "kvguard")
        urls = [u.strip() for u in env["KVGUARD_UPSTREAMS"].split(",") if u.strip()]
        try:
            out["replicas"] = tuple(ReplicaConfig(f"r{i}", u, source) for i, u in enumerate(urls))
        except ValueError as exc:
            raise ValueError(f"KVGUARD_UPSTREAMS: {exc}") from None
    return out


def _with_replica_keys(config: GuardConfig, env: Mapping[str, str]) -> GuardConfig:
    """Each ``[[replicas]] api_key_env`` read from the environment into ``api_key``."""
    if not any(r.api_key_env for r in config.replicas):
        return config
    return dataclasses.replace(config, replicas=with_replica_keys(config.replicas, env))


def with_replica_keys(replicas: tuple[ReplicaConfig, ...],
                      env: Mapping[str, str] | None = None) -> tuple[ReplicaConfig, ...]:
    """``replicas`` with each ``api_key_env`` read from ``env`` (default: the environment)."""
    env = os.environ if env is None else env
    out = []
    for replica in replicas:
        name = replica.api_key_env
        if name is not None:
            if not env.get(name):
                raise ValueError(f"replicas[{replica.replica_id!r}].api_key_env: the "
                                 f"environment variable {name} is not set")
            replica = dataclasses.replace(replica, api_key_env=None, api_key=env[name])
        out.append(replica)
    return tuple(out)


def load_config(path: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None) -> GuardConfig:
    """The TOML file at ``path`` (or ``$KVGUARD_CONFIG``), then ``KVGUARD_*`` env overrides.

    With neither a path nor ``KVGUARD_CONFIG`` the defaults apply (plus env overrides).
    """
    env = os.environ if env is None else env
    path = path if path is not None else env.get("KVGUARD_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ValueError(f"KVGUARD_CONFIG: cannot read {str(path)!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    config = _with_replica_keys(GuardConfig.from_dict(data), env)
    overrides = _env_overrides(env)
    if not overrides:
        return config
    try:
        return dataclasses.replace(config, **overrides)
    except ValueError as exc:
        raise ValueError(f"KVGUARD_* environment override: {exc}") from None


def config_with_upstreams(path: str | os.PathLike | None, upstreams: Sequence[str],
                          state_source: str, redis_url: str | None,
                          replicas_from: str | None = None) -> GuardConfig:
    """What ``kvguard proxy`` and ``kvguard epp`` serve: the config file (or the environment),
    its replicas replaced by ``upstreams`` when any are given (ids ``r0``, ``r1``, …, polled
    as ``state_source``), its ``redis_url`` by ``redis_url`` when given. ``replicas_from``
    (else ``[proxy] replicas_from``) names where the replicas are listed instead
    (:mod:`guard.replicas.discovery`); the list is read once here and must be valid."""
    config = load_config(path)
    if replicas_from is not None:
        config = dataclasses.replace(
            config, proxy=dataclasses.replace(config.proxy, replicas_from=replicas_from))
    if upstreams:
        if config.proxy.replicas_from is not None:
            raise ValueError("--upstream and replicas_from: give one of them")
        replicas = tuple(ReplicaConfig(f"r{i}", url, state_source)
                         for i, url in enumerate(upstreams))
        config = dataclasses.replace(config, replicas=replicas)
    if config.proxy.replicas_from is not None:
        if config.replicas:
            raise ValueError("[[replicas]] and replicas_from: give one of them")
        from guard.replicas.discovery import replica_source

        source = replica_source(config.proxy.replicas_from, state_source)
        config = dataclasses.replace(config, replicas=source.read())
    if redis_url is not None:
        config = dataclasses.replace(config, redis_url=redis_url)
    if not config.replicas:
        raise ValueError("no replicas: give --upstream URL or [[replicas]] in the config")
    return config
