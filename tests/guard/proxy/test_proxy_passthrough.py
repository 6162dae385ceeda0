"""The cheap routes (``[proxy] relayed_paths``), real processes over loopback: relayed to a
vLLM-shaped upstream unpriced, its answer returned as it gave it, counted; the upstream sees its
own key, never the client's."""

import httpx
import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

MODEL = "m"


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("passthrough")
    with running(upstream_child("ok", MODEL)) as upstream:
        config = directory / "proxy.toml"
        config.write_text(open(write_config(directory)).read() + (
            f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream.url}"\nstate_source = "none"\n'
            f'models = ["{MODEL}"]\napi_key = "sk-upstream"\n'))
        with running(proxy_child([], str(config))) as proxy:
            yield proxy, upstream


def test_each_relayed_route_returns_what_the_upstream_returned(relayed, client):
    proxy, upstream = relayed
    for path in ("/version", f"/v1/models/{MODEL}"):
        through = client.get(proxy.url + path)
        direct = httpx.get(upstream.url + path, trust_env=False)
        assert (through.status_code, through.json()) == (direct.status_code, direct.json())
        assert through.headers["x-kvguard-replica"] == "r0"
    tokenized = client.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "abcd"},
                            headers={"authorization": "Bearer client-key"})
    assert tokenized.status_code == 200
    answer = tokenized.json()
    assert (answer["count"], answer["tokens"]) == (4, [0, 1, 2, 3])
    assert answer["received_headers"]["authorization"] == "Bearer sk-upstream"
    assert client.get(proxy.url + "/v1/models/other").status_code == 404  # no replica serves it
    assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 1}
    metrics = client.get(proxy.url + "/kvguard/metrics").text
    assert 'kvguard_proxy_relayed_requests_total{route="/version",status="200"} 1.0' in metrics
    assert 'kvguard_proxy_relayed_requests_total{route="/tokenize",status="200"} 1.0' in metrics
    # unpriced: nothing was offered to admission
    assert "kvguard_requests_offered_total{" not in metrics or all(
        line.endswith(" 0.0") for line in metrics.splitlines()
        if line.startswith("kvguard_requests_offered_total{"))


def test_embeddings_are_admitted_when_configured(tmp_path, client):
    """``admitted_paths`` with ``*/v1/embeddings``: priced by the input, admitted, forwarded as
    sent (no max_tokens added); a malformed input is a 400 that reaches no replica."""
    with running(upstream_child("echo", MODEL)) as upstream:
        config = tmp_path / "proxy.toml"
        config.write_text(
            'admitted_paths = ["*/v1/completions", "*/v1/chat/completions", "*/v1/embeddings"]\n'
            + open(write_config(tmp_path)).read()
            + f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream.url}"\n'
              f'state_source = "none"\nmodels = ["{MODEL}"]\n')
        with running(proxy_child([], str(config))) as proxy:
            body = {"model": MODEL, "input": ["hello there", "general kenobi"]}
            answer = client.post(proxy.url + "/v1/embeddings", json=body)
            assert answer.status_code == 200, answer.text
            assert "x-kvguard-queue-ms" in answer.headers  # admitted, not merely relayed
            assert answer.json()["received"]["body"] == body
            bad = client.post(proxy.url + "/v1/embeddings", json={"model": MODEL, "input": 3})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
            assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 1}
            metrics = client.get(proxy.url + "/kvguard/metrics").text
    assert 'kvguard_requests_offered_total{class="interactive",tenant="anonymous"} 2.0' in metrics
