"""``kvguard epp --replicas-from inferencepool:POOL``: the EPP's endpoints follow the pool's Ready
pods while it runs. A real EppServer (gRPC port bound, polling real state-only replicas on
127.0.0.1), configured as in a pod (``KUBERNETES_SERVICE_HOST``/``PORT``, the service account
folder); :class:`tests.support.fake_kube_apiserver.FakeKubeApiServer`, a real HTTPS server on
127.0.0.1 speaking the Kubernetes list/watch wire format, stands in for kube-apiserver."""

from __future__ import annotations

import asyncio
import dataclasses

from chaos.state_fleet import StateFleet, StateFleetConfig
from guard.config import config_with_upstreams
from guard.epp.server import EppServer
from tests.guard.epp.test_epp_discovery import _decide, _until
from tests.support.fake_kube_apiserver import FakeKubeApiServer, pod, pool_v1, service_account


def test_the_epp_follows_the_inference_pools_ready_pods(tmp_path, monkeypatch):
    account, tls = service_account(tmp_path)

    async def main(kube: FakeKubeApiServer):
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(2)
        ports = [int(url.rsplit(":", 1)[1]) for url in fleet.urls.values()]
        kube.put_pool(pool_v1("llm-pool", {"app": "vllm"}, ports))  # one pod, two servers
        kube.put_pod(pod("x", "127.0.0.1", ready=False))
        kube.put_pod(pod("y", "127.0.0.2"))  # Ready, but nothing answers there
        serving = {f"127.0.0.1:{port}" for port in ports}
        config = config_with_upstreams(None, [], "kvguard", None, "inferencepool:llm-pool")
        assert [r.replica_id for r in config.replicas] == [f"127.0.0.2:{p}" for p in ports]
        config = dataclasses.replace(config, refresh_interval_s=0.05)
        server = EppServer(config)
        await server.start("127.0.0.1", 0)
        picker = server.picker
        try:
            kube.put_pod(pod("x", "127.0.0.1"))  # Ready: its two servers join
            await _until(lambda: all(picker.routable(rid) for rid in serving))
            assert {(await _decide(server)).replica_id for _ in range(6)} <= serving
            kube.delete_pod("y")  # gone: its endpoints leave and are forgotten
            await _until(lambda: set(picker.endpoints) == serving)
            assert picker.endpoints[f"127.0.0.1:{ports[0]}"] == f"127.0.0.1:{ports[0]}"
        finally:
            await server.aclose()
            await fleet.stop()

    with FakeKubeApiServer(tls[0]) as kube:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        monkeypatch.setenv("KVGUARD_K8S_SERVICEACCOUNT_DIR", str(account))
        asyncio.run(asyncio.wait_for(main(kube), 60))
