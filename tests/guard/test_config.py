"""guard.config: defaults, TOML + env overrides, validation naming the key, tenant keys."""

import hmac
import re
from pathlib import Path

import pytest

from guard import config as config_module
from guard.config import (
    ANONYMOUS_TENANT,
    DEFAULT_ADMITTED_PATHS,
    GuardConfig,
    ReplicaConfig,
    TenantConfig,
    hash_api_key,
    load_config,
)
from policies import make_policy

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "guard-config.example.toml"


def test_defaults():
    c = GuardConfig()
    interactive = c.request_class("interactive")
    assert (interactive.ttft_s, interactive.itl_s, interactive.priority) == (1.0, 0.080, 0)
    batch = c.request_class("batch")
    assert (batch.ttft_s, batch.itl_s, batch.priority) == (30.0, 1.0, 2)
    assert c.default_class == "interactive" and c.policy == "slo"
    assert c.max_body_bytes == 1 << 20 and c.default_max_tokens == 256
    assert c.refresh_interval_s == 0.1 and c.initial_chars_per_token == 4.0
    assert c.retry_budget_ratio == 0.10 and c.max_tenant_labels == 20
    assert (c.retry_budget.window_s, c.retry_budget.min_retries) == (10.0, 3)
    assert c.class_header == "x-kvguard-class" and c.deadline_header == "x-kvguard-deadline-ms"
    assert c.allow_anonymous and c.in_process and c.tokenizer is None and c.trace_path is None
    assert c.request_class("nope") is None


def test_example_file_loads_and_a_middleware_accepts_it():
    from guard.middleware import AdmissionMiddleware

    c = load_config(EXAMPLE, env={})
    assert c.in_process and c.admitted_paths == DEFAULT_ADMITTED_PATHS
    assert c.match_tenant("acme-secret-key").name == "acme"
    assert c.policy_params["ttft_safety_ratio"] == 1.2
    guard = AdmissionMiddleware(lambda *a: None, c)  # every policy param is one the policy takes
    assert guard.controller.policy.stale_max_inflight_per_replica == 4
    assert guard.controller.policy.patience.quantile == 0.25
    assert guard.controller.policy.itl_safety_ratio == 1.2


def test_retry_budget_keys_reach_the_budget_every_request_is_recorded_into():
    from guard.middleware import AdmissionMiddleware

    config = GuardConfig(retry_budget_ratio=0.3, retry_budget_window_s=4.0,
                         retry_budget_min_retries=7)
    budget = AdmissionMiddleware(lambda *a: None, config).controller.retry_budgets.config
    assert (budget.budget_ratio, budget.window_s, budget.min_retries) == (0.3, 4.0, 7)


def test_middleware_refuses_replicas_naming_them():
    from guard.config import ReplicaConfig
    from guard.middleware import AdmissionMiddleware

    config = GuardConfig(replicas=(ReplicaConfig("r0", "http://127.0.0.1:9001"),))
    with pytest.raises(ValueError, match=r"^replicas: .*standalone proxy"):
        AdmissionMiddleware(lambda *a: None, config)


@pytest.mark.parametrize("paths", [[], ["/v1/rerank"], ["v1/completions"], "*/v1/completions"])
def test_admitted_paths_are_checked(paths):
    with pytest.raises(ValueError, match="admitted_paths"):
        GuardConfig.from_dict({"admitted_paths": paths})


def test_admitted_path_patterns():
    c = GuardConfig.from_dict({"admitted_paths": ["/api/v1/chat/completions"]})
    assert c.is_admitted_path("/api/v1/chat/completions")
    assert not c.is_admitted_path("/v1/chat/completions")
    default = GuardConfig()
    for path in ("/v1/completions", "/v1/chat/completions", "/api/v1/chat/completions",
                 "/openai/deployments/x/v1/completions", "/v1/responses", "/v1/embeddings"):
        assert default.is_admitted_path(path)
    for path in ("/v1/models", "/health", "/v1/completions/", "/v1/responses/resp_1",
                 "/v1/responses/resp_1/cancel"):
        assert not default.is_admitted_path(path)


def test_toml_then_env_overrides(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(
        'policy = "cap"\nmax_body_bytes = 2048\n'
        "[classes.interactive]\nttft_s = 2\n"
        "[classes.bulk]\nttft_s = 60.0\nitl_s = 2.0\npriority = 3\n"
    )
    env = {
        "KVGUARD_CONFIG": str(path),
        "KVGUARD_MAX_BODY_BYTES": "4096",
        "KVGUARD_ALLOW_ANONYMOUS": "false",
        "KVGUARD_TRACE_PATH": "/tmp/t.jsonl",
        "KVGUARD_UPSTREAMS": "http://127.0.0.1:9001/, http://127.0.0.1:9002",
        "KVGUARD_UPSTREAM_STATE_SOURCE": "vllm",
        "KVGUARD_POLICY_PARAMS": '{"max_concurrency": 8}',
    }
    c = load_config(env=env)
    assert c.policy == "cap"  # from the file
    assert c.max_body_bytes == 4096  # env wins over the file
    assert c.allow_anonymous is False and c.trace_path == "/tmp/t.jsonl"
    assert c.replicas == (
        ReplicaConfig("r0", "http://127.0.0.1:9001", "vllm"),
        ReplicaConfig("r1", "http://127.0.0.1:9002", "vllm"),
    )
    assert dict(c.policy_params) == {"max_concurrency": 8}
    # a partial class table merges over the built-in class; a new class is added
    assert c.request_class("interactive").ttft_s == 2.0
    assert c.request_class("interactive").itl_s == 0.080
    assert c.request_class("bulk").priority == 3


def test_no_file_no_env_is_defaults():
    assert load_config(env={}) == GuardConfig()


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": "big"}, "max_body_bytes"),
        ({"max_body_bytes": True}, "max_body_bytes"),
        ({"default_max_tokens": -1}, "default_max_tokens"),
        ({"refresh_interval_s": 0}, "refresh_interval_s"),
        ({"max_staleness_s": -1.0}, "max_staleness_s"),
        ({"max_queue_wait_s": "x"}, "max_queue_wait_s"),
        ({"initial_chars_per_token": 20.0}, "initial_chars_per_token"),
        ({"retry_budget_ratio": 1.5}, "retry_budget_ratio"),
        ({"retry_budget_window_s": 0}, "retry_budget_window_s"),
        ({"retry_budget_min_retries": -1}, "retry_budget_min_retries"),
        ({"retry_shed_ratio": 0.1}, "retry_shed_ratio"),  # replaced by the retry budget
        ({"default_class": "gold"}, "default_class"),
        ({"policy": ""}, "policy"),
        ({"colour": "blue"}, "colour"),
        ({"classes": {"gold": {"ttft_s": 1.0}}}, "classes.gold"),
        ({"classes": {"interactive": {"ttft_s": -1.0}}}, "classes.interactive"),
        ({"classes": {"interactive": {"ttft_ms": 1}}}, "classes.interactive.ttft_ms"),
        ({"classes": {"interactive": {"priority": "high"}}}, "classes.interactive.priority"),
        ({"tenants": [{"name": "a"}]}, "tenants[0]"),
        ({"tenants": [{"name": "a", "key_sha256": "abc"}]}, "key_sha256"),
        ({"tenants": [{"name": "a", "api_key": "k", "default_class": "gold"}]}, "default_class"),
        ({"tenants": [{"name": "a", "api_key": "k", "tokens_per_minute": 0}]}, "tokens_per_minute"),
        ({"tenants": [{"name": "a", "api_key": "k", "colour": 1}]}, "tenants[0].colour"),
        ({"tenants": [{"name": "a", "api_key": "k"}, {"name": "a", "api_key": "j"}]}, "tenants"),
        ({"tenants": [{"name": "a", "api_key": "k"}, {"name": "b", "api_key": "k"}]}, "tenants"),
        ({"replicas": [{"replica_id": "r0"}]}, "url"),
        ({"replicas": [{"url": "ftp://x"}]}, "url"),
        ({"replicas": [{"url": "http://x", "state_source": "grpc"}]}, "state_source"),
        ({"replicas": [{"url": "http://x"}, {"replica_id": "r0", "url": "http://y"}]}, "replicas"),
        ({"replicas": [{"url": "http://x", "max_model_len": 0}]}, "max_model_len"),
        ({"replicas": [{"url": "http://x", "max_model_len": "big"}]}, "replicas[0].max_model_len"),
        ({"replicas": [{"url": "http://x", "weight": 0}]}, "replicas['r0'].weight: must be a finite"),
        ({"replicas": [{"url": "http://x", "weight": -2.0}]}, "replicas['r0'].weight"),
        ({"replicas": [{"url": "http://x", "weight": float("inf")}]}, "replicas['r0'].weight"),
        ({"replicas": [{"url": "http://x", "weight": float("nan")}]}, "replicas['r0'].weight"),
        ({"replicas": [{"url": "http://x", "weight": "3"}]}, "replicas[0].weight: expected float"),
        ({"replicas": [{"url": "http://x", "weight": True}]}, "replicas[0].weight"),
        ({"policy_params": 3}, "policy_params"),
        ({"class_header": ""}, "class_header"),
    ],
)
def test_validation_error_names_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        GuardConfig.from_dict(data)


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVGUARD_MAX_BODY_BYTES": "lots"}, "KVGUARD_MAX_BODY_BYTES"),
        ({"KVGUARD_ALLOW_ANONYMOUS": "maybe"}, "KVGUARD_ALLOW_ANONYMOUS"),
        ({"KVGUARD_REFRESH_INTERVAL_S": "fast"}, "KVGUARD_REFRESH_INTERVAL_S"),
        ({"KVGUARD_POLICY_PARAMS": "{nope"}, "KVGUARD_POLICY_PARAMS"),
        ({"KVGUARD_POLICY_PARAMS": "[1]"}, "KVGUARD_POLICY_PARAMS"),
        ({"KVGUARD_UPSTREAMS": "localhost:8000"}, "KVGUARD_UPSTREAMS"),
        ({"KVGUARD_MAX_BODY_BYTES": "0"}, "max_body_bytes"),
        ({"KVGUARD_CONFIG": "/nonexistent/kvguard.toml"}, "KVGUARD_CONFIG"),
    ],
)
def test_env_errors_name_the_variable(env, key):
    with pytest.raises(ValueError, match=key):
        load_config(env=env)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("policy = \n")
    with pytest.raises(ValueError, match="bad.toml"):
        load_config(path, env={})


def test_api_keys_are_stored_hashed_and_matched():
    c = GuardConfig.from_dict(
        {"tenants": [{"name": "a", "api_key": "key-a"},
                     {"name": "b", "key_sha256": hash_api_key("key-b").upper(),
                      "default_class": "batch", "may_choose_class": True}]}
    )
    assert c.tenants[0].key_sha256 == hash_api_key("key-a")
    assert "key-a" not in repr(c)
    assert c.match_tenant("key-a").name == "a"
    assert c.match_tenant("key-b").default_class == "batch"
    assert c.match_tenant("key-c") is None and c.match_tenant(None) is None
    assert c.match_tenant("") is None


def test_match_compares_every_tenant_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(config_module.hmac, "compare_digest", spy)
    c = GuardConfig.from_dict({"tenants": [{"name": n, "api_key": n} for n in "abcd"]})
    assert c.match_tenant("a").name == "a"  # the first tenant matches...
    assert len(calls) == 4  # ...and every tenant is still compared (no early exit)


def test_resolve_tenant_anonymous_rules():
    open_config = GuardConfig()  # no tenants: everyone is anonymous, with the default class
    anon = open_config.resolve_tenant(None)
    assert anon.name == ANONYMOUS_TENANT and anon.default_class == "interactive"
    assert not anon.may_choose_class
    tenants = [{"name": "a", "api_key": "key-a"}]
    allowing = GuardConfig.from_dict({"tenants": tenants})
    assert allowing.resolve_tenant("wrong").name == ANONYMOUS_TENANT
    assert allowing.resolve_tenant("key-a").name == "a"
    closed = GuardConfig.from_dict({"tenants": tenants, "allow_anonymous": False})
    assert closed.resolve_tenant(None) is None  # -> 401
    assert closed.resolve_tenant("wrong") is None
    assert closed.resolve_tenant("key-a").name == "a"


def test_dataclasses_are_frozen_and_headers_lowercased():
    c = GuardConfig(class_header="X-Class")
    assert c.class_header == "x-class"
    with pytest.raises(AttributeError):
        c.policy = "other"
    with pytest.raises(AttributeError):
        TenantConfig("a", "0" * 64).name = "b"
    with pytest.raises(TypeError):
        c.policy_params["x"] = 1
    assert ReplicaConfig("local", None, "asgi").url is None
    vllm = GuardConfig.from_dict({"replicas": [{"url": "http://v:8000", "state_source": "vllm",
                                                "max_model_len": 8192}]})
    assert vllm.replicas[0] == ReplicaConfig("r0", "http://v:8000", "vllm", 8192)


def test_replica_weight_defaults_to_one_and_takes_integers():
    config = GuardConfig.from_dict({"replicas": [{"url": "http://a:1", "weight": 3},
                                                 {"url": "http://b:1", "weight": 0.5},
                                                 {"url": "http://c:1"}]})
    assert [r.weight for r in config.replicas] == [3.0, 0.5, 1.0]
    assert isinstance(config.replicas[0].weight, float)


def test_an_unknown_kvguard_variable_refuses_start_up_with_its_name():
    with pytest.raises(ValueError, match=r"KVGUARD_MAX_BODY_BYTE: unknown .*did you mean "
                                         r"KVGUARD_MAX_BODY_BYTES"):
        load_config(env={"KVGUARD_MAX_BODY_BYTE": "4096"})
    with pytest.raises(ValueError, match="KVGUARD_SOMETHING_ELSE: unknown"):
        load_config(env={"KVGUARD_SOMETHING_ELSE": "1"})
    assert load_config(env={"OTHER_VAR": "1", "KVGUARD_POLICY": "slo"}).policy == "slo"


def test_the_example_env_override_names_a_real_policy():
    line = next(x for x in EXAMPLE.read_text().splitlines() if "KVGUARD_POLICY=" in x)
    name = re.search(r"KVGUARD_POLICY=([\w-]+)", line).group(1)
    config = load_config(env={"KVGUARD_POLICY": name})
    assert config.policy == name
    assert make_policy(config.policy) is not None  # raises for a policy that does not exist


@pytest.mark.parametrize("url", ["http://admin:hunter2-redis@cache:6379/0",
                                 "redis//:hunter2-redis@cache:6379",
                                 "tcp://hunter2-redis@cache"])
def test_a_bad_redis_scheme_is_refused_without_echoing_the_password(url):
    with pytest.raises(ValueError, match="redis_url") as info:
        GuardConfig(redis_url=url)
    assert "hunter2-redis" not in str(info.value)
    assert "cache" in str(info.value)  # the rest of the URL still says which one was meant


@pytest.mark.parametrize(("toml", "secret"), [
    ('admin_api_key = 424242424242\n', "424242424242"),
    ('[[tenants]]\nname = "acme"\napi_key = 737373737373\n', "737373737373"),
])
def test_a_mistyped_secret_is_not_echoed(tmp_path, toml, secret):
    path = tmp_path / "guard.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match="api_key") as info:
        load_config(path, env={})
    assert secret not in str(info.value)
