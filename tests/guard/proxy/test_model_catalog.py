"""``ModelCatalog``: replica ids by model, from ``[[replicas]] models`` or ``/v1/models``."""

import asyncio
import json

import pytest

from guard.config import GuardConfig, ReplicaConfig
from guard.errors import PricingError
from guard.proxy.model_catalog import ModelCatalog, parse_model_ids, parse_model_lengths


def _catalog(**models):
    return ModelCatalog([ReplicaConfig(rid, f"http://{rid}:1", models=tuple(names))
                         for rid, names in models.items()])


def test_configured_lists_and_aliases_route():
    catalog = _catalog(a=["m1", "m1-alias"], b=["m1"], c=["m2"])
    assert catalog.replicas_for("m1") == {"a", "b"}
    assert catalog.replicas_for("m1-alias") == {"a"}
    assert catalog.replicas_for("m2") == {"c"}
    assert catalog.replicas_for(None) is None  # no model named: any replica
    assert catalog.polled_urls == {}


def test_an_unknown_model_is_a_404():
    with pytest.raises(PricingError) as raised:
        _catalog(a=["m1"]).replicas_for("nope")
    assert (raised.value.status, raised.value.reason, raised.value.param) == (
        404, "model_not_found", "model")


def test_an_unread_list_may_serve_anything_until_read():
    catalog = _catalog(a=["m1"], b=[])
    assert catalog.polled_urls == {"b": "http://b:1"}
    assert catalog.replicas_for("m2") == {"b"}
    assert catalog.replicas_for("m1") == {"a", "b"}
    catalog.update("b", frozenset({"m2"}))
    assert catalog.replicas_for("m1") == {"a"}
    assert catalog.replicas_for("m2") == {"b"}


def test_refresh_reads_v1_models_and_keeps_the_last_list_on_failure():
    catalog = ModelCatalog([ReplicaConfig("a", "http://a:1", api_key="sk-a"),
                            ReplicaConfig("b", "http://b:1")])
    sent = {}
    answers = {"http://a:1/v1/models": (200, json.dumps({"data": [{"id": "m1"}]}).encode()),
               "http://b:1/v1/models": (500, b"")}

    async def get(url, timeout_s, headers):
        sent[url] = headers
        return answers[url]

    asyncio.run(catalog.refresh(get, 1.0))
    assert (catalog.models_of("a"), catalog.models_of("b")) == ({"m1"}, None)
    assert sent == {"http://a:1/v1/models": [(b"authorization", b"Bearer sk-a")],
                    "http://b:1/v1/models": []}  # a replica's own key, never another's
    answers["http://a:1/v1/models"] = (200, b"not json")
    asyncio.run(catalog.refresh(get, 1.0))
    assert catalog.models_of("a") == {"m1"}


@pytest.mark.parametrize("body", [b"[]", b'{"data": 3}', b"\xff"])
def test_a_body_that_is_no_model_list(body):
    assert parse_model_ids(body) is None


def test_replica_keys_come_from_the_config_or_the_environment_and_are_never_shown(tmp_path):
    from guard.config import load_config

    path = tmp_path / "guard.toml"
    path.write_text('[[replicas]]\nurl = "http://x:1"\napi_key_env = "UPSTREAM_KEY"\n'
                    '[[replicas]]\nurl = "http://y:1"\napi_key = "sk-direct"\n')
    config = load_config(path, env={"UPSTREAM_KEY": "sk-from-env"})
    assert [r.api_key for r in config.replicas] == ["sk-from-env", "sk-direct"]
    assert "sk-" not in repr(config)
    with pytest.raises(ValueError, match=r"api_key_env: the environment variable UPSTREAM_KEY"):
        load_config(path, env={})
    with pytest.raises(ValueError, match="api_key or api_key_env, not both"):
        ReplicaConfig("r", "http://x:1", api_key="a", api_key_env="B")


def test_config_models_key():
    config = GuardConfig.from_dict({"replicas": [{"url": "http://x:1", "models": ["a", "b"]}]})
    assert config.replicas[0].models == ("a", "b")
    for bad in (["a", ""], "a", [1]):
        with pytest.raises(ValueError, match=r"replicas\[.*\]\.models"):
            GuardConfig.from_dict({"replicas": [{"url": "http://x:1", "models": bad}]})


def test_a_list_once_read_is_not_read_again_from_a_busy_replica():
    """llama-cpp-python cuts a running stream when another request (``/v1/models`` too) waits
    for its model: a replica with requests in flight keeps the list read before."""
    catalog = ModelCatalog([ReplicaConfig("a", "http://a:1"), ReplicaConfig("b", "http://b:1")])
    sent = []
    lists = {"a": ["m1"], "b": ["m2"]}

    async def get(url, timeout_s, headers):
        sent.append(url)
        rid = url.split("//")[1][0]
        return 200, json.dumps({"data": [{"id": m} for m in lists[rid]]}).encode()

    in_flight = {"a": 1, "b": 0}
    asyncio.run(catalog.refresh(get, 1.0, in_flight.get))  # never read: read even when busy
    assert sent == ["http://a:1/v1/models", "http://b:1/v1/models"]
    lists.update(a=["m3"], b=["m4"])
    sent.clear()
    asyncio.run(catalog.refresh(get, 1.0, in_flight.get))
    assert sent == ["http://b:1/v1/models"]
    assert (catalog.models_of("a"), catalog.models_of("b")) == ({"m1"}, {"m4"})
    in_flight["a"] = 0  # idle again: read
    asyncio.run(catalog.refresh(get, 1.0, in_flight.get))
    assert catalog.models_of("a") == {"m3"}


def test_a_models_context_is_read_from_its_list_entry():
    listed = json.dumps({"data": [{"id": "a", "max_model_len": 2048}, {"id": "b"},
                                  {"id": "c", "max_model_len": True},
                                  {"id": "d", "max_model_len": 0}]}).encode()
    assert parse_model_lengths(listed) == {"a": 2048}
    assert parse_model_lengths(b"not json") == {}

    async def get(url, timeout_s, headers):
        return 200, listed

    catalog = ModelCatalog([ReplicaConfig("r0", "http://r0")])
    asyncio.run(catalog.refresh(get, 1.0))
    assert catalog.max_model_len("r0", "a") == 2048 and catalog.max_model_len("r0", "b") is None
