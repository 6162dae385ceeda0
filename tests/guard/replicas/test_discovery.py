"""Where a running proxy reads its replicas (``replicas_from``): the file and DNS sources, the
watcher's refusals, and the load state of a replica that leaves."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from guard.config import GuardConfig, ReplicaConfig, config_with_upstreams
from guard.proxy.config import ProxyConfig
from guard.replicas.discovery import (
    DnsReplicas,
    FileReplicas,
    ReplicaWatcher,
    check_replicas_from,
    replica_source,
)
from guard.replicas.load_state import LoadState
from policies.cost import RequestClass, RequestCost


@pytest.mark.parametrize("spec", ["file:/x.toml", "dns:kvguard-replicas.ns.svc:8000",
                                  "dns:[::1]:80", "inferencepool:llm-pool",
                                  "inferencepool:team-a/llm-pool"])
def test_valid_specs(spec):
    check_replicas_from(spec)


@pytest.mark.parametrize("spec", ["", "file:", "dns:name", "dns:name:0", "dns:name:x",
                                  "http://a", 3, "inferencepool:", "inferencepool:/pool",
                                  "inferencepool:a/b/c", "inferencepool:Pool", "k8s:ns/pool"])
def test_bad_specs_are_refused_by_the_config(spec):
    with pytest.raises(ValueError, match="replicas_from"):
        ProxyConfig(replicas_from=spec)


def test_a_toml_file_reads_as_replicas_tables(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[[replicas]]\nreplica_id = "a"\nurl = "http://10.0.0.1:8000/"\n'
                    'weight = 2\n[[replicas]]\nurl = "http://10.0.0.2:8000"\n')
    replicas = FileReplicas(path, "kvguard").read()
    assert replicas == (ReplicaConfig("a", "http://10.0.0.1:8000", "kvguard", weight=2.0),
                        ReplicaConfig("r1", "http://10.0.0.2:8000", "kvguard"))


def test_a_json_file_lists_urls_or_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("R_KEY", "sekret")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"replicas": [
        "http://10.0.0.1:8000", {"replica_id": "b", "url": "http://10.0.0.2:8000",
                                 "state_source": "vllm", "api_key_env": "R_KEY"}]}))
    a, b = FileReplicas(path).read()
    assert (a.replica_id, a.url, a.state_source) == ("http://10.0.0.1:8000",
                                                      "http://10.0.0.1:8000", "auto")
    assert (b.state_source, b.api_key) == ("vllm", "sekret")


@pytest.mark.parametrize("text, reason", [
    ("[", "invalid JSON"), ("[]", "lists no replica"), ('{"a": 1}', "an array"),
    ('[{"url": "http://a", "colour": 1}]', "colour"),
    ('[{"replica_id": "x", "url": "http://a"}, {"replica_id": "x", "url": "http://b"}]',
     "duplicate"),
])
def test_invalid_json_lists_say_why(tmp_path, text, reason):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=reason):
        FileReplicas(path).read()


def test_dns_lists_each_address_on_the_port():
    source = DnsReplicas("pods", 8000, "kvguard",
                         resolve=lambda name, port: ["10.0.0.2", "10.0.0.10", "10.0.0.2", "fd00::1"])
    assert [(r.replica_id, r.url) for r in source.read()] == [
        ("10.0.0.2:8000", "http://10.0.0.2:8000"), ("10.0.0.10:8000", "http://10.0.0.10:8000"),
        ("[fd00::1]:8000", "http://[fd00::1]:8000")]


def test_dns_resolves_for_real_and_a_failure_is_a_refusal():
    replicas = replica_source("dns:localhost:8123").read()
    assert any(r.url == "http://127.0.0.1:8123" for r in replicas)

    def fail(name, port):
        raise OSError("Name or service not known")

    with pytest.raises(ValueError, match="does not resolve"):
        DnsReplicas("gone", 80, resolve=fail).read()


def test_replicas_from_with_fixed_replicas_is_refused(tmp_path):
    listing = tmp_path / "r.json"
    listing.write_text('["http://127.0.0.1:9"]')
    config = tmp_path / "g.toml"
    config.write_text('[[replicas]]\nurl = "http://127.0.0.1:8"\n')
    with pytest.raises(ValueError, match="give one of them"):
        config_with_upstreams(str(config), [], "auto", None, f"file:{listing}")
    with pytest.raises(ValueError, match="give one of them"):
        config_with_upstreams(None, ["http://127.0.0.1:7"], "auto", None, f"file:{listing}")
    loaded = config_with_upstreams(None, [], "kvguard", None, f"file:{listing}")
    assert [r.url for r in loaded.replicas] == ["http://127.0.0.1:9"]
    assert loaded.proxy.replicas_from == f"file:{listing}"


def test_the_watcher_applies_changes_and_refuses_bad_ones_once(tmp_path, caplog):
    path = tmp_path / "r.json"
    path.write_text('["http://127.0.0.1:9"]')
    source = FileReplicas(path)
    first = source.read()
    applied = []

    def apply(replicas):
        if any("refuse" in r.replica_id for r in replicas):
            raise ValueError("apply said no")
        applied.append(replicas)

    watcher = ReplicaWatcher(source, 0.01, apply, first)

    async def rounds(n):
        for _ in range(n):
            await watcher.check()

    asyncio.run(rounds(2))
    assert applied == []  # unchanged bytes: not even re-parsed
    path.write_text('["http://127.0.0.1:9", "http://127.0.0.1:10"]')
    asyncio.run(rounds(1))
    assert [r.url for r in applied[-1]] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    with caplog.at_level(logging.WARNING, "guard.replicas.discovery"):
        path.write_text("nope")
        asyncio.run(rounds(3))
        path.write_text('[{"replica_id": "refuse", "url": "http://127.0.0.1:11"}]')
        asyncio.run(rounds(2))
    assert len(applied) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "invalid JSON" in warnings[0] and "apply said no" in warnings[1]


def _state(request_ids=()):
    return {"block_size": 16, "num_total_blocks": 1000, "num_free_blocks": 900,
            "max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 4096,
            "running": [{"request_id": r, "num_output_tokens": 1, "max_tokens": 10,
                         "num_context_tokens": 20, "num_prefill_tokens_remaining": 0}
                        for r in request_ids], "waiting": []}


def test_a_leaving_replica_is_unroutable_then_forgotten_once_its_requests_end():
    load = LoadState()
    for rid in ("a", "b"):
        load.update_from_kvguard_state(rid, _state(), 0.0)
    cost = RequestCost("q1", "t", RequestClass("c", 1.0, 0.1), 10, 10, 10, 2, 0.0, 60.0)
    load.reserve("b", "q1", cost)
    load.leave("b", 0.1)
    assert not load.is_healthy("b")
    load.update_from_kvguard_state("b", _state(["q1"]), 0.2)  # a late document: still out
    assert not load.is_healthy("b")
    assert [r.healthy for r in load.snapshot(0.3).replicas] == [True, False]
    with pytest.raises(ValueError, match="still holds"):
        load.forget("b")
    load.release("q1")
    load.forget("b")
    assert [r.replica_id for r in load.snapshot(0.4).replicas] == ["a"]
    load.update_from_kvguard_state("b", _state(), 0.5)  # back under the same id: new
    assert load.is_healthy("b")
    assert GuardConfig(replicas=(ReplicaConfig("a", "http://x"),))  # (config unaffected)
