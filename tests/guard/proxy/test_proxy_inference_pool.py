"""A running ``kvguard proxy --replicas-from inferencepool:POOL`` (the real process, configured as
in a pod: ``KUBERNETES_SERVICE_HOST``/``PORT`` and the service account folder) serves the pool's
Ready pods and follows them without a restart, over real state-only replicas on 127.0.0.1.
:class:`tests.support.fake_kube_apiserver.FakeKubeApiServer`, a real HTTPS server on 127.0.0.1
speaking the Kubernetes list/watch wire format, stands in for kube-apiserver."""

from __future__ import annotations

import httpx
import pytest

from tests.guard.proxy.test_proxy_discovery import BODY, _fleet, _proxy, _until, replica_urls
from tests.support.fake_kube_apiserver import FakeKubeApiServer, pod, pool_v1, service_account

pytestmark = pytest.mark.slow

__all__ = ["replica_urls"]  # the module's fleet fixture, shared


def test_the_proxy_follows_an_inference_pools_ready_pods(replica_urls, tmp_path, monkeypatch):
    account, tls = service_account(tmp_path)
    ports = [int(url.rsplit(":", 1)[1]) for url in replica_urls[:2]]
    local = sorted(f"127.0.0.1:{port}" for port in ports)
    elsewhere = sorted(f"127.0.0.2:{port}" for port in ports)  # nothing listens there
    with FakeKubeApiServer(tls[0]) as kube:
        kube.put_pool(pool_v1("llm-pool", {"app": "vllm"}, ports))
        kube.put_pod(pod("x", "127.0.0.1"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        monkeypatch.setenv("KVGUARD_K8S_SERVICEACCOUNT_DIR", str(account))
        with _proxy(tmp_path, "inferencepool:llm-pool") as proxy, httpx.Client(
                timeout=30, trust_env=False) as client:
            pid = proxy.pid
            _until(lambda: all(r["routable"] for r in _fleet(client, proxy.url).values()),
                   what="x's servers routable")
            assert sorted(_fleet(client, proxy.url)) == local
            answers = [client.post(proxy.url + "/v1/completions", json=BODY) for _ in range(4)]
            assert {r.headers["x-kvguard-replica"] for r in answers} == set(local)

            kube.put_pod(pod("y", "127.0.0.2"))  # Ready: joins (unroutable, nothing there)
            _until(lambda: set(elsewhere) <= set(_fleet(client, proxy.url)), what="y joined")
            kube.put_pod(pod("x", "127.0.0.1", ready=False))  # NotReady: leaves, is forgotten
            _until(lambda: sorted(_fleet(client, proxy.url)) == elsewhere, what="x gone")
            kube.put_pod(pod("x", "127.0.0.1"))  # Ready again: back, routable
            _until(lambda: all(_fleet(client, proxy.url).get(rid, {}).get("routable")
                               for rid in local), what="x back")
            assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
            assert proxy.pid == pid  # the same process all along
