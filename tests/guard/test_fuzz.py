"""Hypothesis drives random and mutated request bodies and headers through the guarded engine
app (the tiny torch model behind ``AdmissionMiddleware``, in-process ASGI): no 5xx other than a
proper shed, no exception or traceback, and the state at rest afterwards (no held tickets, every
KV block free). Deterministic (``derandomize=True``) and bounded in examples."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.slow

KEY = "sk-fuzz"
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
         "/kvguard/state", "/nope")
VALID = {
    "/v1/completions": {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                        "stream": False, "temperature": 0.0},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 3, "stream": True},
}
NUM_EXAMPLES = 150
DEEP = 20_000  # hypothesis raises the recursion limit while it runs: go well past it


def _build_app():
    from engine.async_engine import AsyncEngine
    from engine.gguf_loader import find_smollm2_gguf
    from engine.llm_engine import LLMEngine
    from engine.metrics import EngineMetrics
    from engine.server import build_app
    from engine.tokenizer import Tokenizer
    from guard.config import GuardConfig
    from guard.middleware import AdmissionMiddleware

    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=64)
    async_engine = AsyncEngine(engine)
    inner = build_app(async_engine, "tiny", Tokenizer.from_gguf(find_smollm2_gguf()),
                      EngineMetrics(CollectorRegistry(), "tiny"), max_body_bytes=1 << 16)
    config = GuardConfig.from_dict({
        "policy": "slo", "allow_anonymous": False, "max_body_bytes": 1 << 16,
        "tenants": [{"name": "acme", "api_key": KEY}]})
    registry = CollectorRegistry()
    return AdmissionMiddleware(inner, config=config, registry=registry), async_engine, registry


@pytest.fixture(scope="module")
def guarded():
    loop = asyncio.new_event_loop()
    app, async_engine, registry = _build_app()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                               base_url="http://127.0.0.1", timeout=60.0)
    yield loop, client, async_engine, registry
    loop.run_until_complete(client.aclose())
    loop.run_until_complete(app.aclose())
    loop.run_until_complete(async_engine.shutdown(5.0))
    loop.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@st.composite
def bodies(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(("mutated", "mutated", "mutated", "json", "bytes", "deep")))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        depth = draw(st.sampled_from((1, 10, 63, 64, 65, 200, 1100, DEEP)))
        opener, closer = draw(st.sampled_from(((b"[", b"]"), (b'{"a":', b"}"))))
        value = opener * depth + b"1" + closer * depth
        return b'{"prompt": ' + value + b', "messages": ' + value + b"}"
    body = json.loads(json.dumps(VALID.get(path, VALID["/v1/completions"])))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(body) + ["n", "best_of", "tools", "stop", "seed",
                                                   "stream_options", "max_completion_tokens",
                                                   "top_p", "priority", "content"]))
        action = draw(st.sampled_from(("set", "delete", "message")))
        if action == "delete":
            body.pop(key, None)
        elif action == "message" and "messages" in body:
            body["messages"].append(draw(st.dictionaries(
                st.sampled_from(("role", "content", "name", "tool_calls")),
                json_values | st.sampled_from(("user", "assistant", "system", "tool")),
                max_size=3)))
        else:
            body[key] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # bounded work per example; huge values are tried elsewhere
    return json.dumps(body).encode()


@st.composite
def requests(draw):
    path = draw(st.sampled_from(PATHS[:2] * 10 + PATHS[2:]))
    headers = {"authorization": draw(st.sampled_from((f"Bearer {KEY}",) * 4 + ("Bearer x", "")))
               or None}
    for name in ("content-type", "x-kvguard-class", "idempotency-key", "x-kvguard-deadline-ms",
                 "x-stainless-retry-count", "x-stainless-read-timeout", "x-request-id"):
        if draw(st.booleans()):
            headers[name] = draw(header_text)
    method = "GET" if path in ("/v1/models", "/health", "/kvguard/state") else "POST"
    body = draw(bodies(path)) if method == "POST" else b""
    return method, path, {k: v for k, v in headers.items() if v is not None}, body


def _held_tickets(registry) -> float:
    return registry.get_sample_value("kvguard_held_tickets") or 0.0


@settings(max_examples=NUM_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=requests())
@example(request=("POST", "/v1/completions", {"authorization": f"Bearer {KEY}"},
                  b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"))  # was a RecursionError
@example(request=("POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY}"},
                  b'{"messages": [{"role": "assistant"}]}'))  # was a TypeError in the template
def test_fuzzed_requests_never_5xx_and_leave_nothing_held(guarded, request, caplog):
    loop, client, _, registry = guarded
    method, path, headers, body = request
    with caplog.at_level(logging.WARNING):
        response = loop.run_until_complete(
            client.request(method, path, headers=headers, content=body))
    event(f"{path} {response.status_code}")
    assert response.status_code < 500 or (
        response.status_code == 503 and response.headers.get("x-kvguard-reason")
        and response.headers.get("retry-after")), (path, body[:200], response.text[:300])
    assert "Traceback" not in response.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert _held_tickets(registry) == 0


def test_state_is_at_rest_after_the_fuzz(guarded):
    loop, client, async_engine, registry = guarded
    state = async_engine.state()
    assert state["num_free_blocks"] == state["num_total_blocks"]
    assert state["running"] == [] and state["waiting"] == []
    assert _held_tickets(registry) == 0
    response = loop.run_until_complete(client.post(
        "/v1/completions", json=VALID["/v1/completions"],
        headers={"authorization": f"Bearer {KEY}"}))
    assert response.status_code == 200, response.text
