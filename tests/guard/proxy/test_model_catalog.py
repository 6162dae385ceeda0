"""``ModelCatalog``: replica ids by model, from ``[[replicas]] models`` or ``/v1/models``."""

import asyncio
import json
import math
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.config import GuardConfig, ReplicaConfig
from guard.errors import PricingError
from guard.proxy import model_catalog
from guard.proxy.app import ProxyApp
from guard.proxy.model_catalog import (
    MAX_LISTS_PER_ROUND,
    ModelCatalog,
    parse_model_ids,
    parse_model_lengths,
)
from tests.support.loopback import LoopbackServer, serve_on


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


class _Fleet:
    """``n`` unconfigured replicas ``r0``.. serving ``lists[rid]``; ``round()`` runs one
    refresh and answers the replica ids it read, in the order of the fleet."""

    def __init__(self, n):
        self.ids = [f"r{i}" for i in range(n)]
        self.catalog = ModelCatalog([ReplicaConfig(rid, f"http://{rid}:1") for rid in self.ids])
        self.lists = {rid: ["m"] for rid in self.ids}
        self.in_flight = dict.fromkeys(self.ids, 0)
        self.named: dict[str, str] = {}  # the model each replica's state names
        self.failing: set[str] = set()  # replicas answering 500

    def round(self):
        read = []

        async def get(url, timeout_s, headers):
            rid = url.split("//")[1].split(":")[0]
            read.append(rid)
            if rid in self.failing:
                return 500, b""
            return 200, json.dumps({"data": [{"id": m} for m in self.lists[rid]]}).encode()

        asyncio.run(self.catalog.refresh(get, 1.0, self.in_flight.get, self.named.get))
        return sorted(read, key=self.ids.index)


def test_a_small_fleet_has_every_list_read_every_round():
    fleet = _Fleet(4)
    for _ in range(3):
        assert fleet.round() == fleet.ids
    fleet.lists["r2"] = ["m2"]
    fleet.round()
    assert fleet.catalog.models_of("r2") == {"m2"}


def test_a_large_fleet_reads_the_unread_and_a_budget_of_the_others_in_turn():
    fleet = _Fleet(64)
    assert MAX_LISTS_PER_ROUND < 64
    fleet.failing.add("r9")  # never answers a list: never read, so tried every round
    assert fleet.round() == fleet.ids  # at start-up every list is unread
    turns = math.ceil((len(fleet.ids) - 1) / MAX_LISTS_PER_ROUND)
    seen: set[str] = set()
    for _ in range(turns):
        read = fleet.round()
        assert "r9" in read
        assert len(read) == MAX_LISTS_PER_ROUND + 1  # the budget besides the unread one
        seen.update(read)
    assert seen == set(fleet.ids)  # every list re-read within ceil(N / budget) rounds


def test_a_busy_replica_keeps_its_turn_until_it_is_idle():
    fleet = _Fleet(64)
    fleet.round()
    first = fleet.round()  # the least recently read: the fleet's first 16
    assert first == fleet.ids[:MAX_LISTS_PER_ROUND]
    fleet.in_flight["r16"] = 1  # busy when its turn comes: passed over
    second = fleet.round()
    assert "r16" not in second and len(second) == MAX_LISTS_PER_ROUND
    fleet.in_flight["r16"] = 0
    assert fleet.round()[0] == "r16"  # the first round it is idle, not a whole rotation later


def test_a_state_naming_a_model_its_list_lacks_has_the_list_read_at_the_next_round():
    fleet = _Fleet(64)
    fleet.round()
    fleet.round()  # r0..r15 had their turn: r40 is far from its own
    fleet.lists["r40"] = ["m-new"]  # restarted with another model, which its state names
    fleet.named["r40"] = "m-new"
    fleet.named["r41"] = "m"  # a state that names the model its list has: no extra read
    read = fleet.round()
    assert "r40" in read and "r41" not in read
    assert len(read) == MAX_LISTS_PER_ROUND + 1  # besides the budget
    assert fleet.catalog.models_of("r40") == {"m-new"}
    assert fleet.catalog.replicas_for("m-new") == {"r40"}


def test_a_state_that_names_a_model_no_list_gives_prompts_one_read_only():
    fleet = _Fleet(64)
    fleet.round()
    fleet.named["r50"] = "other-name"  # what its state calls the model /v1/models lists as m
    assert "r50" in fleet.round()
    assert "r50" not in fleet.round()  # not every round: its turn only
    fleet.in_flight["r51"] = 1
    fleet.named["r51"] = "m2"
    assert "r51" not in fleet.round()  # busy: the prompted read waits for an idle round
    fleet.in_flight["r51"] = 0
    assert "r51" in fleet.round()


def test_each_model_a_state_names_and_each_new_list_allow_a_prompted_read():
    fleet = _Fleet(64)
    fleet.round()
    for model in ("m2", "m", "m2"):
        fleet.lists["r50"] = [model]
        fleet.named["r50"] = model
        assert "r50" in fleet.round()
        assert fleet.catalog.models_of("r50") == {model}
    # its list, read on its turn, changed under a state that still names m2 (two restarts
    # between two state polls): the same name prompts again, the list having changed
    fleet.catalog.update("r50", frozenset({"m3"}))
    assert "r50" in fleet.round()
    assert fleet.catalog.models_of("r50") == {"m2"}


def _replica_app(served: dict) -> Starlette:
    """A kvguard replica that answers its ``/kvguard/state`` and ``/v1/models`` with the
    model ``served["model"]`` names (a restart with another model: the test changes it)."""

    async def state(request):
        return JSONResponse({
            "model": served["model"], "backend": "sim", "max_model_len": 4096,
            "block_size": 16, "num_total_blocks": 7000, "num_free_blocks": 7000,
            "max_num_seqs": 256, "max_num_batched_tokens": 2048, "num_preemptions": 0,
            "step_count": 1, "now_s": 1.0, "running": [], "waiting": [], "iterations": [],
            "timing_model": None, "time_scale": 1.0})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": served["model"]}]})

    return Starlette(routes=[Route("/kvguard/state", state), Route("/v1/models", models)])


def test_a_proxy_rereads_the_list_of_a_replica_whose_state_names_another_model(monkeypatch):
    """Real HTTP, proxy in-process: with no list read in turn at all (a budget of 0), the
    proxy still sees a replica's new model, through the model its state document names."""
    monkeypatch.setattr(model_catalog, "MAX_LISTS_PER_ROUND", 0)
    monkeypatch.setattr(model_catalog, "MIN_LIST_INTERVAL_S", 0.02)
    served = {"model": "m-old"}
    with LoopbackServer(_replica_app(served)) as replica:
        app = ProxyApp(GuardConfig.from_dict({
            "refresh_interval_s": 0.02,
            "replicas": [{"replica_id": "r0", "url": replica.url}]}))

        async def models_of():
            return app.models.models_of("r0")

        with serve_on(app, "kvguard") as proxy:
            assert proxy.call(models_of()) == {"m-old"}  # read at start-up
            served["model"] = "m-new"
            deadline = time.monotonic() + 20  # a hang guard, not a timing assertion
            while proxy.call(models_of()) != {"m-new"} and time.monotonic() < deadline:
                time.sleep(0.02)
            assert proxy.call(models_of()) == {"m-new"}
