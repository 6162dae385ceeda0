"""Never-servable requests against a real ``kvguard engine --model tiny --guard CONFIG`` process:
the right 4xx, never retry, no KV blocks or admissions consumed, the server healthy after."""

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-test-acme"
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN_KEY = "sk-test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CONFIG = f"""
policy = "slo"
max_body_bytes = 4096
allow_anonymous = false
admin_api_key = "{ADMIN_KEY}"
[[tenants]]
name = "acme"
api_key = "{KEY}"
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = tmp_path_factory.mktemp("guard") / "guard.toml"
    config.write_text(CONFIG)
    with start_engine(["--model", "tiny", "--device", "cpu", "--num-blocks", "64",
                       "--guard", str(config)]) as eng:
        with httpx.Client(base_url=eng.base_url, timeout=30.0, trust_env=False) as client:
            yield client


def _metric(client, name):
    total = 0.0
    for line in client.get("/kvguard/metrics", headers=ADMIN).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi", ', AUTH, 400, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2, 3]", AUTH, 400, "invalid_json"),
    ("max_tokens wrong type", "/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', AUTH, 400, "invalid_type"),
    ("stream wrong type", "/v1/completions", b'{"prompt": "hi", "stream": "yes"}', AUTH, 400, "invalid_type"),
    ("missing prompt", "/v1/completions", b'{"model": "tiny", "max_tokens": 4}', AUTH, 400, "missing_required_parameter"),
    ("missing messages", "/v1/chat/completions", b'{"model": "tiny"}', AUTH, 400, "missing_required_parameter"),
    ("bad role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', AUTH, 400, "invalid_type"),
    ("model not served", "/v1/completions", b'{"model": "gpt-9", "prompt": [1], "max_tokens": 2}', AUTH, 404, "model_not_found"),
    ("n of two", "/v1/completions", b'{"prompt": [1], "max_tokens": 2, "n": 2}', AUTH, 400, "unsupported_value"),
    ("over the context", "/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 100000}', AUTH, 400, "context_length_exceeded"),
    # the two 500s of the reliability battery (RecursionError, TypeError in the chat template)
    ("nested 1,100 deep", "/v1/completions", b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}", AUTH, 400, "invalid_json"),
    ("assistant without content", "/v1/chat/completions", b'{"messages": [{"role": "assistant"}]}', AUTH, 400, "invalid_type"),
    ("body over the limit", "/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'"}', AUTH, 413, "body_too_large"),
    ("unknown tenant key", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', {"authorization": "Bearer sk-nope"}, 401, "invalid_api_key"),
    ("no key", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', {}, 401, "invalid_api_key"),
]


@pytest.mark.parametrize(("path", "body", "headers", "status", "reason"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_never_servable_is_4xx_and_costs_nothing(engine, path, body, headers, status, reason):
    admitted_before = _metric(engine, "kvguard_requests_admitted_total")
    response = engine.post(path, content=body,
                           headers={"content-type": "application/json", **headers})
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-kvguard-reason"] == reason
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["code"] == reason and error["message"]
    assert _metric(engine, "kvguard_requests_admitted_total") == admitted_before
    assert _metric(engine, "kvguard_held_tickets") == 0
    state = engine.get("/kvguard/state", headers=ADMIN).json()
    assert state["num_free_blocks"] == state["num_total_blocks"]
    assert state["running"] == [] and state["waiting"] == []


def test_server_is_healthy_and_serves_after_bad_input(engine):
    for _, path, body, headers, _, _ in CASES:
        engine.post(path, content=body, headers={"content-type": "application/json", **headers})
    assert engine.get("/health").status_code == 200
    response = engine.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    rejected = _metric(engine, "kvguard_requests_rejected_total")
    assert rejected >= 2 * len(CASES)


@pytest.mark.parametrize(("path", "headers", "status"), [
    ("/kvguard/state", {}, 401), ("/kvguard/state", AUTH, 403), ("/kvguard/state", ADMIN, 200),
    ("/kvguard/metrics", {}, 401), ("/kvguard/metrics", {"authorization": "Bearer sk-nope"}, 401),
    ("/kvguard/metrics", AUTH, 403), ("/kvguard/metrics", ADMIN, 200),
    ("/metrics", {}, 401), ("/metrics", AUTH, 403), ("/metrics", ADMIN, 200),
    ("/v1/models", {}, 401), ("/v1/models", AUTH, 200), ("/v1/models", ADMIN, 200),
    ("/health", {}, 200),
])
def test_operational_endpoints_need_the_admin_key_when_anonymous_is_refused(engine, path,
                                                                           headers, status):
    response = engine.get(path, headers=headers)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["code"] == ("admin_key_required" if status == 403 else "invalid_api_key")
        assert "acme" not in response.text  # nothing about tenants leaks
