"""``kvguard proxy --state-source stream``: the real proxy process reads real state-only
replicas over one long-lived ``/kvguard/state/stream`` response each, routes on what they
report, and keeps their state fresh without a request per poll."""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from chaos.child import ChildProcess
from chaos.topology import http_health
from tests.support.fleet_cli import fleet_cli

pytestmark = pytest.mark.slow

CONFIG = "refresh_interval_s = 0.1\nstate_timeout_s = 1.0\n"


def test_the_proxy_routes_on_streamed_state(tmp_path):
    config = tmp_path / "proxy.toml"
    config.write_text(CONFIG)
    with fleet_cli("--replicas", "2", "--state-only", "--proxies", "0") as (_, lines):
        urls = [line[1] for line in lines if line[0].startswith("replica-")]
        upstreams = [a for url in urls for a in ("--upstream", url)]
        proxy = ChildProcess("proxy", lambda port: [
            sys.executable, "-m", "guard.cli", "proxy", *upstreams, "--state-source", "stream",
            "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            http_health, ready_pattern=r"kvguard proxy listening on (\S+)")
        proxy.start(60)
        try:
            with httpx.Client(timeout=30, trust_env=False) as client:
                body = {"model": "llama-7b", "prompt": "hello", "max_tokens": 300, "stream": True}
                with client.stream("POST", proxy.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    replica = r.headers["x-kvguard-replica"]
                    time.sleep(0.3)  # mid-stream: the replica's stream shows it running
                    state = client.get(proxy.url + "/kvguard/state").json()
                    r.read()
                seen = {s["replica_id"]: s for s in state["replicas"]}
                assert all(s["capacity_known"] and s["routable"] for s in seen.values())
                assert all(s["state_age_s"] < 0.5 for s in seen.values())  # fresh
                assert seen[replica]["num_free_blocks"] < seen[replica]["num_total_blocks"]
                assert all(s["stream_events"] > 0 and s["stream_gaps"] == 0
                           for s in seen.values())
                answers = [client.post(proxy.url + "/v1/completions",
                                       json={**body, "stream": False, "max_tokens": 8})
                           for _ in range(4)]
                assert all(a.status_code == 200 for a in answers)
        finally:
            proxy.terminate()
