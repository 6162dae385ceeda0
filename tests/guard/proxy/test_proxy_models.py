"""Routing by model, real processes over loopback: a 2-model fleet of sim engines (2 replicas
each, their models read from ``/v1/models``) behind ``kvguard proxy`` routes a mixed stream with
no misroute; a model no replica serves is a 404 at the proxy that reaches no replica."""

import contextlib
import sys

import httpx
import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

from chaos.child import ChildProcess
from chaos.topology import http_health

pytestmark = pytest.mark.slow

GROUPS = {"model-a": ("a0", "a1"), "model-b": ("b0", "b1")}


def _engine(name: str, model: str) -> ChildProcess:
    return ChildProcess(name, lambda port: [
        sys.executable, "-m", "guard.cli", "engine", "--model", "llama-7b", "--backend", "sim",
        "--time-scale", "0", "--served-model-name", model, "--host", "127.0.0.1",
        "--port", str(port)], http_health, ready_pattern=r"kvguard engine listening on (\S+)")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Four sim engines, two per model, and a proxy that reads their models itself."""
    directory = tmp_path_factory.mktemp("models")
    engines = {rid: _engine(rid, model) for model, rids in GROUPS.items() for rid in rids}
    with contextlib.ExitStack() as stack:
        for engine in engines.values():
            stack.enter_context(running(engine))
        config = directory / "proxy.toml"
        replicas = "".join(f'[[replicas]]\nreplica_id = "{rid}"\nurl = "{engine.url}"\n'
                           for rid, engine in engines.items())
        config.write_text(open(write_config(directory)).read() + replicas)
        proxy = stack.enter_context(running(proxy_child([], str(config))))
        yield proxy


def test_a_mixed_stream_is_never_misrouted(fleet, client):
    routed: dict[str, list[str]] = {model: [] for model in GROUPS}
    for i in range(24):
        model = "model-a" if i % 3 else "model-b"
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        body = ({"messages": [{"role": "user", "content": f"hi {i}"}]} if i % 2
                else {"prompt": f"the quick brown fox {i}"})
        response = client.post(fleet.url + path, json={"model": model, "max_tokens": 4, **body})
        assert response.status_code == 200, response.text  # a misroute is the engine's 404
        replica = response.headers["x-kvguard-replica"]
        assert replica in GROUPS[model], (model, replica)
        routed[model].append(replica)
    assert [len(replicas) for replicas in routed.values()] == [16, 8]


def test_an_unknown_model_is_a_404_from_the_proxy(fleet, client):
    response = client.post(fleet.url + "/v1/completions",
                           json={"model": "model-z", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found", "model", "invalid_request_error")
    assert "x-kvguard-replica" not in response.headers


def test_an_unknown_model_reaches_no_replica(tmp_path, client):
    """A replica whose models the config lists: asked for another model, the proxy answers 404
    and the replica counts no request; its own model goes through."""
    with running(upstream_child("ok", "served")) as upstream:
        config = tmp_path / "proxy.toml"
        config.write_text(open(write_config(tmp_path)).read() + (
            f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream.url}"\nstate_source = "none"\n'
            'models = ["served", "alias-of-served"]\n'))
        with running(proxy_child([], str(config))) as proxy:
            missed = client.post(proxy.url + "/v1/completions",
                                 json={"model": "other", "prompt": "x", "max_tokens": 2})
            assert missed.status_code == 404
            assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 0}
            for model in ("served", "alias-of-served"):
                answered = client.post(proxy.url + "/v1/completions",
                                       json={"model": model, "prompt": "x", "max_tokens": 2})
                assert answered.status_code == 200, answered.text
            assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 2}


def test_a_prompt_is_checked_against_its_own_models_context(tmp_path, client):
    """Two vLLM-shaped replicas whose ``/v1/models`` give different ``max_model_len``: a
    prompt over the small model's context is a 400 from the proxy that reaches no replica;
    the same prompt to the bigger model is admitted."""
    with running(upstream_child("ok", "small", max_model_len=512)) as small, \
            running(upstream_child("ok", "big", max_model_len=8192)) as big:
        config = tmp_path / "proxy.toml"
        config.write_text(open(write_config(tmp_path)).read() + "".join(
            f'[[replicas]]\nreplica_id = "{rid}"\nurl = "{u.url}"\nstate_source = "none"\n'
            for rid, u in (("s0", small), ("b0", big))))
        with running(proxy_child([], str(config))) as proxy:
            prompt = "lorem ipsum " * 250  # about 750 tokens by the initial estimate
            refused = client.post(proxy.url + "/v1/completions",
                                  json={"model": "small", "prompt": prompt, "max_tokens": 16})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"
            assert "512" in refused.json()["error"]["message"]
            admitted = client.post(proxy.url + "/v1/completions",
                                   json={"model": "big", "prompt": prompt, "max_tokens": 16})
            assert admitted.status_code == 200, admitted.text
            assert admitted.headers["x-kvguard-replica"] == "b0"
            posts = [httpx.get(u.url + "/count", trust_env=False).json()["posts"]
                     for u in (small, big)]
    assert posts == [0, 1]
