"""``replicas_from = "inferencepool:NAMESPACE/POOL"``: the replicas follow an InferencePool's
Ready pods. No cluster runs here: :class:`tests.support.fake_kube_apiserver.FakeKubeApiServer`,
a real HTTP(S) server on 127.0.0.1 speaking the Kubernetes list/watch wire format (chunked JSON
watch events, resourceVersion, 410 Gone, bearer tokens), stands in for kube-apiserver. The
source is driven by the real :class:`ReplicaWatcher`; what a list change then does to a proxy or
an EPP is the membership machinery's (tests/guard/epp/test_epp_inference_pool.py runs it)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from guard.config import config_with_upstreams
from guard.replicas.discovery import ReplicaWatcher, replica_source
from guard.replicas.inference_pool import ApiServer, InferencePoolReplicas
from tests.support.fake_kube_apiserver import (
    V1,
    FakeKubeApiServer,
    pod,
    pool_v1,
    pool_v1alpha2,
    self_signed_tls,
)

APP = {"app": "vllm"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """The API server's certificate (None without the openssl command): one per module."""
    return self_signed_tls(tmp_path_factory.mktemp("apiserver-tls"))


@pytest.fixture
def kube(tmp_path, tls):
    """The stand-in API server (HTTPS when the openssl command is there) and the service
    account folder a pod would have (token, ca.crt, namespace)."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    if tls is not None:
        (account / "ca.crt").write_bytes(tls[1].read_bytes())
    (account / "token").write_text("token-1\n")
    (account / "namespace").write_text("default")
    with FakeKubeApiServer(tls[0] if tls else None) as server:
        server.account = account
        server.api = ApiServer(server.url, account / "token",
                               account / "ca.crt" if tls else None, account / "namespace")
        yield server


def _ids(replicas) -> list[str]:
    return [r.replica_id for r in replicas]


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


class Following:
    """A source read at start and then followed by a real ReplicaWatcher; ``lists``: the
    replica ids of each list it applied."""

    def __init__(self, source: InferencePoolReplicas) -> None:
        self.source = source
        self.start_ids = _ids(source.read())
        self.lists: list[list[str]] = [self.start_ids]
        self.watcher = ReplicaWatcher(source, 0.05, self._apply, source.read())

    def _apply(self, replicas) -> None:
        self.lists.append(_ids(replicas))

    @property
    def now(self) -> list[str]:
        return self.lists[-1]

    async def __aenter__(self) -> Following:
        self.watcher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.watcher.stop()


def _source(kube, pool: str = "llm-pool") -> InferencePoolReplicas:
    return InferencePoolReplicas("default", pool, "vllm", kube.api)


def test_ready_pods_joining_leaving_and_deleted_change_the_replicas_while_running(kube):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))
    kube.put_pod(pod("b", "127.0.1.2", ready=False))
    kube.put_pod(pod("other", "127.0.1.3", labels={"app": "something-else"}))
    kube.put_pod(pod("pending", None, ready=False))
    kube.put_pod(pod("terminating", "127.0.1.4", deleting=True))

    async def main():
        async with Following(_source(kube)) as f:
            assert f.start_ids == ["127.0.1.1:8000"]
            await _until(lambda: kube.open_watches("/pods"))
            kube.put_pod(pod("b", "127.0.1.2"))  # becomes Ready: joins
            await _until(lambda: f.now == ["127.0.1.1:8000", "127.0.1.2:8000"])
            kube.put_pod(pod("a", "127.0.1.1", ready=False))  # NotReady: leaves
            await _until(lambda: f.now == ["127.0.1.2:8000"])
            kube.put_pod(pod("a", "127.0.1.1"))
            kube.delete_pod("b")  # deleted: leaves
            await _until(lambda: f.now == ["127.0.1.1:8000"])
            replica = f.watcher._current[0]
            assert (replica.url, replica.state_source) == ("http://127.0.1.1:8000", "vllm")
        # one list at start, one when following began: no restart, no relist
        assert len(kube.lists("/pods")) == 2

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_410_gone_watch_lists_the_pods_again(kube):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))

    async def main():
        async with Following(_source(kube)) as f:
            await _until(lambda: kube.open_watches("/pods"))
            lists = len(kube.lists("/pods"))
            kube.compact()  # the watch ends with 410 Gone: its version is no longer kept
            kube.put_pod(pod("b", "127.0.1.2"))
            await _until(lambda: f.now == ["127.0.1.1:8000", "127.0.1.2:8000"])
            assert len(kube.lists("/pods")) == lists + 1
            kube.put_pod(pod("c", "127.0.1.3"))  # and the new watch follows on
            await _until(lambda: len(f.now) == 3)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_dropped_watch_resumes_from_the_last_version_seen(kube):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))

    async def main():
        async with Following(_source(kube)) as f:
            await _until(lambda: kube.open_watches("/pods"))
            kube.put_pod(pod("b", "127.0.1.2"))
            await _until(lambda: len(f.now) == 2)
            seen = kube._objects[("pods", "b")]["metadata"]["resourceVersion"]
            lists = len(kube.lists("/pods"))
            kube.drop_watches()
            await _until(lambda: len(kube.watches("/pods")) == 2)
            assert kube.watches("/pods")[-1].query["resourceVersion"] == seen
            kube.put_pod(pod("b", "127.0.1.2", ready=False))
            await _until(lambda: f.now == ["127.0.1.1:8000"])
            assert len(kube.lists("/pods")) == lists  # resumed, not listed again

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_token_is_read_again_once_rotated(kube):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))

    async def main():
        async with Following(_source(kube)) as f:
            # both watches under way (the pool's too), so no request reads the old token after this
            await _until(lambda: kube.open_watches("/pods") and kube.open_watches("/inferencepools"))
            (kube.account / "token").write_text("token-2\n")  # the kubelet rotates it
            kube.tokens = {"token-2"}  # and the old one expires
            seen = len(kube.requests)
            kube.drop_watches()
            kube.put_pod(pod("b", "127.0.1.2"))
            await _until(lambda: len(f.now) == 2)
            assert {r.token for r in kube.requests[seen:]} == {"token-2"}

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_refused_token_is_retried_and_read_again(kube, caplog):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))

    async def main():
        async with Following(_source(kube)) as f:
            await _until(lambda: kube.open_watches("/pods"))
            kube.tokens = {"token-2"}  # expired before the file was rotated
            kube.drop_watches()
            await _until(lambda: "HTTP 401" in caplog.text)
            (kube.account / "token").write_text("token-2\n")
            kube.put_pod(pod("b", "127.0.1.2"))
            await _until(lambda: len(f.now) == 2)

    with caplog.at_level(logging.WARNING, "guard.replicas.inference_pool"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert "HTTP 401" in caplog.text


def test_a_changed_pool_selects_anew_and_a_deleted_one_keeps_the_replicas(kube, caplog):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))
    kube.put_pod(pod("b", "127.0.1.2", labels={"app": "vllm-next"}))

    async def main():
        async with Following(_source(kube)) as f:
            await _until(lambda: kube.watches("/inferencepools"))
            kube.put_pool(pool_v1("llm-pool", {"app": "vllm-next"}, [8000, 8001]))
            await _until(lambda: f.now == ["127.0.1.2:8000", "127.0.1.2:8001"])
            kube.delete_pool(V1, "llm-pool")
            await _until(lambda: "was deleted" in caplog.text)
            kube.put_pod(pod("c", "127.0.1.3", labels={"app": "vllm-next"}))
            await asyncio.sleep(0.3)
            assert f.now == ["127.0.1.2:8000", "127.0.1.2:8001"]  # last known, no change
            kube.put_pool(pool_v1("llm-pool", {"app": "vllm-next"}, [8000]))
            await _until(lambda: f.now == ["127.0.1.2:8000", "127.0.1.3:8000"])

    with caplog.at_level(logging.WARNING, "guard.replicas.inference_pool"):
        asyncio.run(asyncio.wait_for(main(), 30))


def test_an_older_v1alpha2_pool_is_read_as_well(kube):
    kube.put_pool(pool_v1alpha2("old-pool", APP, 8000))
    kube.put_pod(pod("a", "127.0.1.1"))
    kube.put_pod(pod("b", "fd00::7"))
    assert _ids(_source(kube, "old-pool").read()) == ["127.0.1.1:8000", "[fd00::7]:8000"]


@pytest.mark.parametrize("pool, reason", [
    (None, "InferencePool default/llm-pool not found"),
    (pool_v1("llm-pool", None, [8000]), "has no pod selector"),
    (pool_v1("llm-pool", {}, [8000]), "has no pod selector"),
    (pool_v1("llm-pool", APP, []), "has no target port"),
    ({**pool_v1("llm-pool", APP, [8000]), "spec": {
        "selector": {"matchLabels": APP, "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["gpu"]}]},
        "targetPorts": [{"number": 8000}]}}, "matchExpressions is not supported"),
    (pool_v1("llm-pool", {"app": "nothing-runs-this"}, [8000]), "no Ready pod"),
])
def test_a_bad_pool_is_a_clear_error_at_start(kube, pool, reason):
    if pool is not None:
        kube.put_pool(pool)
    kube.put_pod(pod("a", "127.0.1.1"))
    with pytest.raises(ValueError, match=reason):
        _source(kube).read()


def test_a_refused_service_account_says_what_it_needs(kube):
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.tokens = set()
    with pytest.raises(ValueError, match="401.*needs get/watch on inferencepools"):
        _source(kube).read()


def test_outside_a_pod_it_says_so(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST is not set"):
        config_with_upstreams(None, [], "vllm", None, "inferencepool:default/llm-pool")


def test_in_a_pod_it_finds_the_api_server_and_namespace_from_the_environment(kube, monkeypatch,
                                                                              tmp_path):
    """KUBERNETES_SERVICE_HOST/PORT and the mounted service account (its folder overridden):
    HTTPS verified against its ca.crt (another CA's is refused), the namespace from its file."""
    if not kube.url.startswith("https"):
        pytest.skip("needs the openssl command for the API server's certificate")
    kube.put_pool(pool_v1("llm-pool", APP, [8000]))
    kube.put_pod(pod("a", "127.0.1.1"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
    monkeypatch.setenv("KVGUARD_K8S_SERVICEACCOUNT_DIR", str(kube.account))
    config = config_with_upstreams(None, [], "vllm", None, "inferencepool:llm-pool")
    assert _ids(config.replicas) == ["127.0.1.1:8000"]
    assert replica_source("inferencepool:llm-pool").spec == "inferencepool:llm-pool"
    other = tmp_path / "other"
    other.mkdir()
    self_signed_tls(other)
    (kube.account / "ca.crt").write_bytes((other / "ca.crt").read_bytes())
    with pytest.raises(ValueError, match="inferencepool:llm-pool: cannot reach.*CERTIFICATE_VERIFY"):
        config_with_upstreams(None, [], "vllm", None, "inferencepool:llm-pool")


@pytest.mark.parametrize("pool, line", [
    (None, "kvguard epp: error: inferencepool:llm-pool: InferencePool default/llm-pool not found "
           "(looked in inference.networking.k8s.io/v1 and inference.networking.x-k8s.io/v1alpha2)"),
    (pool_v1("llm-pool", None, [8000]),
     "kvguard epp: error: inferencepool:llm-pool: InferencePool default/llm-pool has no pod "
     "selector (spec.selector.matchLabels names no label)"),
])
def test_kvguard_epp_refuses_to_start_on_a_bad_pool_with_one_clear_line(kube, monkeypatch,
                                                                         capsys, pool, line):
    if not kube.url.startswith("https"):
        pytest.skip("needs the openssl command for the API server's certificate")
    from guard.cli import main

    if pool is not None:
        kube.put_pool(pool)
    kube.put_pod(pod("a", "127.0.1.1"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
    monkeypatch.setenv("KVGUARD_K8S_SERVICEACCOUNT_DIR", str(kube.account))
    assert main(["epp", "--replicas-from", "inferencepool:llm-pool", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == line
