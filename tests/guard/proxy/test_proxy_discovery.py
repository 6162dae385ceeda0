"""A running ``kvguard proxy --replicas-from file:PATH`` picks up replicas that join and leave
(no restart): real state-only replicas (``kvguard fleet --state-only``) and the real proxy
process over loopback. A joining replica is polled and becomes routable; a leaving one takes
no new request, its stream in flight finishes, then it is forgotten; an invalid list changes
nothing and says why."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

import httpx
import pytest

from chaos.child import ChildProcess
from chaos.topology import http_health
from tests.support.fleet_cli import fleet_cli

pytestmark = pytest.mark.slow

CONFIG = """
policy = "{policy}"
refresh_interval_s = 0.1
state_timeout_s = 0.5
[proxy]
connect_timeout_s = 0.5
read_timeout_s = 5.0
replicas_from_interval_s = 0.1
"""
BODY = {"model": "llama-7b", "prompt": "hello there", "max_tokens": 4}


def _replicas_toml(urls: dict[str, str]) -> str:
    return "".join(f'[[replicas]]\nreplica_id = "{rid}"\nurl = "{url}"\nstate_source = '
                   f'"kvguard"\n\n' for rid, url in urls.items())


@pytest.fixture(scope="module")
def replica_urls():
    with fleet_cli("--replicas", "3", "--state-only", "--proxies", "0") as (proc, lines):
        urls = {line[0]: line[1] for line in lines if line[0].startswith("replica-")}
        assert len(urls) == 3, lines
        yield list(urls.values())


@contextlib.contextmanager
def _proxy(tmp_path, spec: str, policy: str = "round_robin"):
    config = tmp_path / "proxy.toml"
    config.write_text(CONFIG.format(policy=policy))
    child = ChildProcess("proxy", lambda port: [
        sys.executable, "-m", "guard.cli", "proxy", "--replicas-from", spec, "--config",
        str(config), "--log-level", "info", "--host", "127.0.0.1", "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)")
    child.start(60)
    try:
        yield child
    finally:
        child.terminate()


def _fleet(client: httpx.Client, url: str) -> dict[str, dict]:
    return {r["replica_id"]: r for r in client.get(url + "/kvguard/state").json()["replicas"]}


def _until(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_joining_replica_becomes_routable_without_a_restart(replica_urls, tmp_path):
    listing = tmp_path / "replicas.toml"
    listing.write_text(_replicas_toml({"a": replica_urls[0]}))
    with _proxy(tmp_path, f"file:{listing}") as proxy, httpx.Client(timeout=30,
                                                                     trust_env=False) as client:
        pid = proxy.pid
        assert list(_fleet(client, proxy.url)) == ["a"]
        seen = {client.post(proxy.url + "/v1/completions", json=BODY)
                .headers["x-kvguard-replica"] for _ in range(4)}
        assert seen == {"a"}

        listing.write_text(_replicas_toml({"a": replica_urls[0], "b": replica_urls[1]}))
        _until(lambda: _fleet(client, proxy.url).get("b", {}).get("routable"),
               what="b routable")
        assert _fleet(client, proxy.url)["b"]["capacity_known"] is True  # its state was read
        answers = [client.post(proxy.url + "/v1/completions", json=BODY) for _ in range(6)]
        assert all(r.status_code == 200 for r in answers)
        assert {r.headers["x-kvguard-replica"] for r in answers} == {"a", "b"}
        metrics = client.get(proxy.url + "/kvguard/metrics").text
        assert 'kvguard_proxy_replica_routable{replica="b"} 1.0' in metrics
        assert proxy.pid == pid  # the same process all along


def test_a_leaving_replica_drains_then_is_forgotten(replica_urls, tmp_path):
    listing = tmp_path / "replicas.json"  # a's state source given, b's the CLI's default
    listing.write_text(json.dumps([{"replica_id": "a", "url": replica_urls[0],
                                    "state_source": "stream"},
                                   {"replica_id": "b", "url": replica_urls[1]}]))
    with _proxy(tmp_path, f"file:{listing}") as proxy, httpx.Client(timeout=30,
                                                                     trust_env=False) as client:
        _until(lambda: all(r["routable"] for r in _fleet(client, proxy.url).values()),
               what="both routable")
        # a long stream on b (round robin: the first or the second request lands there)
        stream_on_b: dict = {}
        started = threading.Event()

        def stream() -> None:
            with httpx.Client(timeout=60, trust_env=False) as own:
                for _ in range(2):
                    with own.stream("POST", proxy.url + "/v1/completions",
                                    json={**BODY, "max_tokens": 400, "stream": True}) as r:
                        if r.headers.get("x-kvguard-replica") != "b":
                            r.read()
                            continue
                        started.set()
                        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                        stream_on_b.update(status=r.status_code, lines=lines)
                        return

        worker = threading.Thread(target=stream, daemon=True)
        worker.start()
        assert started.wait(20), "no stream landed on b"
        listing.write_text(json.dumps([{"replica_id": "a", "url": replica_urls[0],
                                        "state_source": "stream"}]))
        leaving = _until(lambda: _fleet(client, proxy.url).get("b", {}).get("leaving")
                         and _fleet(client, proxy.url)["b"], what="b leaving")
        assert leaving["routable"] is False and leaving["num_inflight"] == 1
        # while b drains, every new request goes to a
        answers = [client.post(proxy.url + "/v1/completions", json=BODY) for _ in range(4)]
        assert {r.headers["x-kvguard-replica"] for r in answers} == {"a"}
        worker.join(60)
        assert stream_on_b["status"] == 200 and stream_on_b["lines"][-1] == "data: [DONE]"
        assert sum('"text"' in line for line in stream_on_b["lines"]) == 400
        _until(lambda: "b" not in _fleet(client, proxy.url), what="b forgotten")
        metrics = client.get(proxy.url + "/kvguard/metrics").text  # its gauges go (counters stay)
        assert 'kvguard_proxy_replica_routable{replica="b"}' not in metrics
        assert 'kvguard_replica_concurrency_limit{replica="b"}' not in metrics
        # it may come back (same id, same URL) once forgotten
        listing.write_text(json.dumps([{"replica_id": "a", "url": replica_urls[0],
                                        "state_source": "stream"},
                                       {"replica_id": "b", "url": replica_urls[1]}]))
        _until(lambda: _fleet(client, proxy.url).get("b", {}).get("routable"),
               what="b back")
        assert "update ignored" not in proxy.output()  # every list above was applied


@pytest.mark.parametrize("bad, reason", [
    ("[[replicas]]\nurl = 'ftp://nope'\n", "must start with http"),
    ("not toml ==", "invalid TOML"),
    ("", "lists no replica"),
    ("[[replicas]]\nreplica_id = 'a'\nurl = 'http://127.0.0.1:1'\n", "changed (url"),
])
def test_an_invalid_list_changes_nothing_and_says_why(replica_urls, tmp_path, bad, reason):
    listing = tmp_path / "replicas.toml"
    listing.write_text(_replicas_toml({"a": replica_urls[0], "c": replica_urls[2]}))
    with _proxy(tmp_path, f"file:{listing}", policy="slo") as proxy, \
            httpx.Client(timeout=30, trust_env=False) as client:
        _until(lambda: all(r["routable"] for r in _fleet(client, proxy.url).values()),
               what="both routable")
        before = {rid: r["url"] for rid, r in _fleet(client, proxy.url).items()}
        listing.write_text(bad)
        _until(lambda: "update ignored" in proxy.output() and reason in proxy.output(),
               what="the warning")
        time.sleep(0.3)  # a few more rounds
        after = _fleet(client, proxy.url)
        assert {rid: r["url"] for rid, r in after.items()} == before
        assert all(r["routable"] for r in after.values())
        assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
