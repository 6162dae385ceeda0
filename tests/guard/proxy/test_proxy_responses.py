"""``/v1/responses`` and ``/v1/embeddings`` through the real proxy (admitted by default), in
front of a vLLM-shaped upstream over loopback: priced and admitted; a Responses stream (typed
events, no ``[DONE]``) that ends with ``response.completed`` counts as completed with its first
token at the first text delta, one cut before that event as failed."""

import json
import time

import httpx
import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

MODEL = "m"
LABELS = '{class="interactive",tenant="anonymous"}'


def _proxy(directory, upstream):
    config = directory / "proxy.toml"
    config.write_text(open(write_config(directory)).read() + (
        f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream.url}"\nstate_source = "none"\n'
        f'models = ["{MODEL}"]\n'))
    return proxy_child([], str(config))


def _counters(client, url, want):
    """The proxy's outcome counters once ``want`` requests have been released."""
    deadline = time.monotonic() + 10.0
    while True:
        text = client.get(url + "/kvguard/metrics").text
        counts = {}
        for name in ("completed", "failed", "goodput", "offered"):
            family = "kvguard_goodput_total" if name == "goodput" else f"kvguard_requests_{name}_total"
            line = next((x for x in text.splitlines() if x.startswith(family + LABELS)), None)
            counts[name] = 0 if line is None else int(float(line.rsplit(" ", 1)[1]))
        if counts["completed"] + counts["failed"] >= want or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _events(response):
    return [json.loads(line[len("data: "):]) for line in response.iter_lines()
            if line.startswith("data: ")]


def test_responses_admitted_streamed_and_not(tmp_path, client):
    with running(upstream_child("echo", MODEL)) as upstream, \
            running(_proxy(tmp_path, upstream)) as proxy:
        body = {"model": MODEL, "input": [{"role": "user", "content": "hello"}],
                "instructions": "be brief"}
        answer = client.post(proxy.url + "/v1/responses", json=body)
        assert answer.status_code == 200, answer.text
        assert "x-kvguard-queue-ms" in answer.headers  # admitted, not relayed
        payload = answer.json()
        assert payload["object"] == "response" and payload["usage"]["output_tokens"] == 3
        # no max_output_tokens: filled with the priced value, under its own name, and said so
        assert payload["received"]["body"]["max_output_tokens"] == 256
        assert answer.headers["x-kvguard-max-tokens"] == "256"
        with client.stream("POST", proxy.url + "/v1/responses",
                           json={**body, "stream": True, "max_output_tokens": 8}) as streamed:
            assert streamed.status_code == 200
            events = _events(streamed)
        assert [e["type"] for e in events][-1] == "response.completed"
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
            == "a b c"
        counts = _counters(client, proxy.url, 2)
        bad = client.post(proxy.url + "/v1/responses",
                               json={"model": MODEL, "input": "hi", "max_output_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == \
            "max_output_tokens"
        assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 2}
    # both completed, within the class's first-token limit: the stream's first token was seen
    assert (counts["completed"], counts["failed"], counts["goodput"]) == (2, 0, 2)


def test_responses_stream_cut_before_its_end_event_counts_failed(tmp_path, client):
    with running(upstream_child("cut", MODEL)) as upstream, \
            running(_proxy(tmp_path, upstream)) as proxy:
        with client.stream("POST", proxy.url + "/v1/responses",
                           json={"model": MODEL, "input": "hi", "stream": True,
                                 "max_output_tokens": 8}) as streamed:
            events = _events(streamed)
        assert events and all(e["type"] != "response.completed" for e in events)
        counts = _counters(client, proxy.url, 1)
    assert (counts["completed"], counts["failed"], counts["goodput"]) == (0, 1, 0)


def test_embeddings_admitted_by_default(tmp_path, client):
    """Priced by the input alone (nothing generated, no max_tokens added), admitted with the
    default ``admitted_paths``; a malformed input is a 400 that reaches no replica."""
    with running(upstream_child("echo", MODEL)) as upstream, \
            running(_proxy(tmp_path, upstream)) as proxy:
        body = {"model": MODEL, "input": ["hello there", "general kenobi"]}
        answer = client.post(proxy.url + "/v1/embeddings", json=body)
        assert answer.status_code == 200, answer.text
        assert "x-kvguard-queue-ms" in answer.headers and "x-kvguard-max-tokens" not in \
            answer.headers
        assert answer.json()["received"]["body"] == body  # forwarded as sent
        assert len(answer.json()["data"]) == 2
        bad = client.post(proxy.url + "/v1/embeddings", json={"model": MODEL, "input": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert httpx.get(upstream.url + "/count", trust_env=False).json() == {"posts": 1}
        counts = _counters(client, proxy.url, 1)
    assert (counts["offered"], counts["completed"]) == (2, 1)


def test_the_openai_sdk_reads_responses_through_the_proxy(tmp_path):
    """The official SDK's ``responses.create``, streamed and not, through the proxy."""
    openai = pytest.importorskip("openai")
    with running(upstream_child("ok", MODEL)) as upstream, \
            running(_proxy(tmp_path, upstream)) as proxy:
        sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                            http_client=httpx.Client(trust_env=False))
        answer = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=8)
        assert answer.output_text == "a b c" and answer.usage.output_tokens == 3
        kinds, text = [], ""
        for event in sdk.responses.create(model=MODEL, input="hello", max_output_tokens=8,
                                          stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        assert text == "a b c" and kinds[-1] == "response.completed"
