"""No secret in anything kvguard prints: a run configured with recognisable secrets (tenant API
key, admin key, Redis password), every output grepped.

Real processes over loopback: a redis-server that asks for the password (down at start-up, up,
then killed: every budget-backend transition logs), ``kvguard proxy`` at DEBUG, and
``kvguard engine --backend sim --guard`` (the in-process middleware) at DEBUG. Requests that
succeed, fail authentication, carry a 5,000-digit retry counter, and read the admin pages; the
bodies, headers, state pages, metrics and both processes' whole output are searched."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from chaos import ports

sys.path.insert(0, str(Path(__file__).resolve().parent / "proxy"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from proxy_helpers import proxy_child, running, upstream_child  # noqa: E402
from server_helpers import start_engine  # noqa: E402

pytestmark = pytest.mark.slow

TENANT_KEY = "sk-tenant-SECRET-4f1a9e"
ADMIN_KEY = "sk-admin-SECRET-9c2b71"
REDIS_PASSWORD = "redis-SECRET-77e3d0"
SECRETS = (TENANT_KEY, ADMIN_KEY, REDIS_PASSWORD)
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
RETRY_HEADERS = ("x-stainless-retry-count", "x-envoy-attempt-count",
                 "grpc-previous-rpc-attempts", "x-retry-count")
BODY = {"model": "llama-7b", "prompt": "the quick brown fox", "max_tokens": 4}


def _config(redis_port: int) -> str:
    return f"""
policy = "slo"
refresh_interval_s = 0.1
allow_anonymous = false
admin_api_key = "{ADMIN_KEY}"
redis_url = "redis://default:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0"
[budget]
tokens_per_minute = 1000000
retry_max_s = 0.2
[[tenants]]
name = "acme"
api_key = "{TENANT_KEY}"
"""


class _Redis:
    """redis-server with ``requirepass`` on a fixed port (started late, killed by pid)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="kvguard-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--requirepass", REDIS_PASSWORD],
            stdout=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _wait_for_line(child, text: str, timeout_s: float = 30.0) -> bool:
    """Poll the child's output for ``text``; ``timeout_s`` is a hang guard, not a timing claim."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if text in child.output():
            return True
        time.sleep(0.1)
    return False


def _exercise(client: httpx.Client, url: str) -> list[str]:
    """Requests of every kind; what came back (status lines, headers, bodies) as text."""
    seen = []

    def keep(response: httpx.Response) -> httpx.Response:
        seen.append(f"{response.status_code} {dict(response.headers)} {response.text}")
        return response

    assert keep(client.post(url + "/v1/completions", json=BODY, headers=AUTH)).status_code == 200
    for name in RETRY_HEADERS:  # Python's int() refuses 4,301+ digits: never a 500
        response = keep(client.post(url + "/v1/completions", json=BODY,
                                    headers={**AUTH, name: "7" * 5000}))
        assert response.status_code == 200, (name, response.text)
    wrong = keep(client.post(url + "/v1/completions", json=BODY,
                             headers={"authorization": f"Bearer {TENANT_KEY}x"}))
    assert wrong.status_code == 401
    assert keep(client.get(url + "/kvguard/state", headers=AUTH)).status_code in (401, 403)
    for path in ("/kvguard/state", "/kvguard/metrics", "/metrics"):
        assert keep(client.get(url + path, headers=ADMIN)).status_code == 200
    return seen


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret} printed:\n{text[-3000:]}"


def test_no_secret_in_any_output_of_the_proxy(tmp_path):
    redis = _Redis(ports.free_port())
    config = tmp_path / "guard.toml"
    config.write_text(_config(redis.port))
    try:
        with running(upstream_child("ok", "llama-7b")) as upstream, \
                running(proxy_child([upstream.url], str(config), state_source="none",
                                    extra_args=("--log-level", "debug"))) as proxy, \
                httpx.Client(timeout=30.0, trust_env=False) as client:
            assert _wait_for_line(proxy, "not reached at start-up")  # Redis down: logged
            seen = _exercise(client, proxy.url)
            redis.start()
            assert _wait_for_line(proxy, "local -> redis")  # recovery: logged
            seen += _exercise(client, proxy.url)
            redis.kill()
            for _ in range(20):  # failures open the breaker (logged) on the local share
                seen.append(client.post(proxy.url + "/v1/completions", json=BODY,
                                        headers=AUTH).text)
            _wait_for_line(proxy, "redis -> local share", timeout_s=10.0)
        output = proxy.output()
        assert "redis://default:***@127.0.0.1" in output  # the URL is named, redacted
        _assert_no_secret(output, *seen)
    finally:
        redis.kill()


def test_no_secret_in_any_output_of_the_middleware(tmp_path):
    redis = _Redis(ports.free_port())
    config = tmp_path / "guard.toml"
    config.write_text(_config(redis.port))
    try:
        with start_engine(["--model", "llama-7b", "--backend", "sim", "--guard", str(config),
                           "--log-level", "debug"]) as engine, \
                httpx.Client(timeout=30.0, trust_env=False) as client:
            seen = _exercise(client, engine.base_url)
            redis.start()
            deadline_s = time.monotonic() + 30
            while "local -> redis" not in engine.output() and time.monotonic() < deadline_s:
                time.sleep(0.1)
            seen += _exercise(client, engine.base_url)
            output = engine.output()
        assert "not reached at start-up" in output and "local -> redis" in output
        _assert_no_secret(output, *seen)
    finally:
        redis.kill()


@pytest.mark.parametrize("upstream_client", ["h1", "aiohttp"])
def test_no_secret_in_the_proxy_output_when_its_replica_fails(tmp_path, upstream_client):
    """A replica that answers garbage: the 502 bodies and the proxy's DEBUG log (where the
    client library's exception, which may dump the request's headers, is written) carry no
    key; the tenant's key went upstream in ``Authorization``."""
    config = tmp_path / "guard.toml"
    config.write_text(_config(ports.free_port()) + f'[proxy]\nupstream_client = "{upstream_client}"\n')
    with running(upstream_child("garbage", "llama-7b")) as upstream, \
            running(proxy_child([upstream.url], str(config), state_source="none",
                                extra_args=("--log-level", "debug"))) as proxy, \
            httpx.Client(timeout=30.0, trust_env=False) as client:
        bodies = []
        for _ in range(2):
            response = client.post(proxy.url + "/v1/completions", json=BODY, headers=AUTH)
            assert response.status_code == 502, response.text
            bodies.append(response.text)
        assert _wait_for_line(proxy, "proxy: replica r0 failed")
        _assert_no_secret(proxy.output(), *bodies)
