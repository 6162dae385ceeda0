"""``replicas_from = "inferencepool:[NAMESPACE/]POOL"``: the replicas are the Ready pods of a
Gateway API inference extension ``InferencePool``, found as the extension's reference EPP finds
them: through the Kubernetes API, with the pod's own service account.

The pool (``inference.networking.k8s.io/v1``, else the older
``inference.networking.x-k8s.io/v1alpha2``) names a label selector (v1: ``selector.matchLabels``;
v1alpha2: ``selector`` itself) and its target ports (v1: ``targetPorts[].number``; v1alpha2:
``targetPortNumber``). Each pod of the pool's namespace that the selector matches, is Ready
(condition ``Ready`` is ``"True"``), has a ``podIP`` and is not being deleted, is one replica per
target port: ``http://IP:PORT``, id ``IP:PORT`` (Envoy's ``ORIGINAL_DST`` cluster connects to
that address, as it does for ``dns:`` replicas).

Start-up (:meth:`InferencePoolReplicas.read` before :meth:`~InferencePoolReplicas.follow`): one
GET of the pool and one list of its pods; a pool that is missing or selects nothing, an API
server that refuses the service account (RBAC), or no Ready pod is a ValueError that says so.
While it runs (:meth:`~InferencePoolReplicas.follow`, started by
:class:`guard.replicas.discovery.ReplicaWatcher`): the pods are listed, then watched from the
list's ``resourceVersion``; a watch that ends or drops resumes from the last version seen, one
answered ``410 Gone`` (the version was compacted away) lists again. The pool is watched as well:
a changed selector or port list selects anew; a deleted pool keeps the replicas last known.
Failures retry with a backoff doubling up to :data:`MAX_BACKOFF_S`, each distinct one logged
once. The watcher applies a changed set through the usual membership machinery
(:mod:`guard.replicas.membership`), so joins are polled and leaves drain as for ``file:`` and
``dns:``.

Where the API server is: ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` (set in every
pod), the service account's ``token``, ``ca.crt`` and ``namespace`` in
``/var/run/secrets/kubernetes.io/serviceaccount`` (``KVGUARD_K8S_SERVICEACCOUNT_DIR`` names
another folder). The token is read again for every request: the kubelet rotates it in place.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from guard.config import ReplicaConfig

__all__ = ["ApiServer", "InferencePoolReplicas", "PoolSpec", "parse_pool_ref"]

log = logging.getLogger(__name__)

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# the InferencePool's API versions, newest first: the first that has the pool serves it
POOL_APIS = ("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")
WATCH_TIMEOUT_S = 300  # asked of the API server per watch; a silent stream is dropped past it
REQUEST_TIMEOUT_S = 10.0  # a GET or list, and the connect of a watch
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 30.0

_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def parse_pool_ref(ref: str) -> tuple[str | None, str]:
    """``NAMESPACE/POOL`` or ``POOL`` (the service account's namespace: None here) -> the pair;
    ValueError unless each is a Kubernetes object name."""
    namespace, _, pool = ref.rpartition("/")
    names = [pool] + ([namespace] if namespace or "/" in ref else [])
    if not all(_NAME.fullmatch(name) and len(name) <= 253 for name in names):
        raise ValueError(f"must be 'inferencepool:[NAMESPACE/]POOL', got 'inferencepool:{ref}'")
    return namespace or None, pool


class ApiError(Exception):
    """The API server answered ``status`` (not 2xx) with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if message else f"HTTP {status}")
        self.status = status


class Gone(ApiError):
    """410: the resourceVersion asked for is no longer kept; list again."""


@dataclass(frozen=True)
class ApiServer:
    """Where the Kubernetes API is and how to prove who we are to it."""

    url: str  # https://HOST:PORT
    token_path: Path
    ca_path: Path | None  # None: the system's trust store
    namespace_path: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ApiServer:
        """In a pod: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the mounted service account
        (``KVGUARD_K8S_SERVICEACCOUNT_DIR`` overrides its folder); ValueError outside one."""
        env = os.environ if env is None else env
        host = env.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ValueError("KUBERNETES_SERVICE_HOST is not set: inferencepool: reads the "
                             "Kubernetes API from inside a pod")
        port = env.get("KUBERNETES_SERVICE_PORT") or "443"
        host = f"[{host}]" if ":" in host else host
        folder = Path(env.get("KVGUARD_K8S_SERVICEACCOUNT_DIR") or SERVICEACCOUNT_DIR)
        ca = folder / "ca.crt"
        return cls(f"https://{host}:{port}", folder / "token", ca if ca.exists() else None,
                   folder / "namespace")

    def headers(self) -> dict[str, str]:
        """Read the token now (it is rotated in place)."""
        try:
            token = self.token_path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the service account token {self.token_path}: "
                             f"{exc.strerror}") from None
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    def namespace(self) -> str:
        try:
            return self.namespace_path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"no namespace given and cannot read {self.namespace_path}: "
                             f"{exc.strerror}") from None

    def ssl_context(self) -> ssl.SSLContext:
        if self.ca_path is None:
            return ssl.create_default_context()
        try:
            return ssl.create_default_context(cafile=str(self.ca_path))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the API server's CA {self.ca_path}: {exc}") from None

    def client_options(self) -> dict[str, Any]:
        """What an httpx client to it needs (no proxy from the environment)."""
        return {"base_url": self.url, "verify": self.ssl_context(), "trust_env": False,
                "timeout": REQUEST_TIMEOUT_S}


@dataclass(frozen=True)
class PoolSpec:
    """What of an InferencePool selects its replicas."""

    api: str  # group/version it was found under
    selector: tuple[tuple[str, str], ...]  # label -> value, sorted
    ports: tuple[int, ...]
    resource_version: str

    def label_selector(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.selector)

    def same_selection(self, other: PoolSpec) -> bool:
        return (self.selector, self.ports) == (other.selector, other.ports)


def pool_spec(obj: Any, api: str, where: str) -> PoolSpec:
    """The pool object's selector and ports; ValueError naming what is missing."""
    spec = obj.get("spec") if isinstance(obj, dict) else None
    if not isinstance(spec, dict):
        raise ValueError(f"{where} has no spec")
    selector = spec.get("selector")
    if api.endswith("/v1") and isinstance(selector, dict):
        if selector.get("matchExpressions"):
            raise ValueError(f"{where}: spec.selector.matchExpressions is not supported "
                             "(matchLabels only)")
        selector = selector.get("matchLabels")
    if not isinstance(selector, dict) or not selector or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in selector.items()):
        raise ValueError(f"{where} has no pod selector (spec.selector"
                         f"{'.matchLabels' if api.endswith('/v1') else ''} names no label)")
    if api.endswith("/v1"):
        ports = [p.get("number") if isinstance(p, dict) else None
                 for p in spec.get("targetPorts") or []]
    else:
        ports = [spec.get("targetPortNumber")]
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        field = "targetPorts[].number" if api.endswith("/v1") else "targetPortNumber"
        raise ValueError(f"{where} has no target port (spec.{field})")
    version = str(obj.get("metadata", {}).get("resourceVersion", ""))
    return PoolSpec(api, tuple(sorted(selector.items())), tuple(ports), version)


def ready_ip(pod: Any) -> str | None:
    """The pod's IP while it can take requests: Ready, addressed, not being deleted."""
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    if metadata.get("deletionTimestamp") or not status.get("podIP"):
        return None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return status["podIP"] if condition.get("status") == "True" else None
    return None


def _ip_key(ip: str) -> tuple:
    try:
        address = ipaddress.ip_address(ip)
        return (address.version, int(address))
    except ValueError:
        return (9, ip)


def _error_of(response: httpx.Response, body: bytes) -> ApiError:
    try:
        message = json.loads(body).get("message", "")
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    return (Gone if response.status_code == 410 else ApiError)(response.status_code, message)


class InferencePoolReplicas:
    """A ``replicas_from`` source: the Ready pods of one InferencePool (module docstring).
    ``api``: where the API server is (default: :meth:`ApiServer.from_env`)."""

    def __init__(self, namespace: str | None, pool: str, state_source: str = "auto",
                 api: ApiServer | None = None) -> None:
        self._api = api
        self._namespace = namespace
        self.pool = pool
        self.spec = f"inferencepool:{namespace + '/' if namespace else ''}{pool}"
        self._state_source = state_source
        self._selection: PoolSpec | None = None
        self._pods: dict[str, str | None] = {}  # pod name -> its IP while Ready
        self._ips: tuple[str, ...] = ()  # the Ready pods' IPs, sorted
        self._version = 0  # bumped whenever the pool's endpoints change
        self._read_version = 0  # nothing new until follow() lists
        self.updated = asyncio.Event()  # set on a change (the watcher wakes for it)
        self._failures = 0  # in a row, since a watch was last accepted
        self._last_problem: str | None = None

    # --- what the ReplicaWatcher asks -----------------------------------------------------
    def changed(self) -> bool:
        return self._version != self._read_version

    def read(self) -> tuple[ReplicaConfig, ...]:
        """The replicas: from what :meth:`follow` keeps, or (before it runs, at start-up) from
        one GET of the pool and one list of its pods. ValueError: why there are none."""
        if self._selection is None:
            self._read_once()
        self._read_version = self._version
        return self._replicas()

    def _replicas(self) -> tuple[ReplicaConfig, ...]:
        from guard.replicas.discovery import build_replicas

        assert self._selection is not None
        if not self._ips:
            raise ValueError(f"{self.spec}: no Ready pod with an IP matches the pool's selector "
                             f"{self._selection.label_selector()}")
        items = []
        for ip in self._ips:
            host = f"[{ip}]" if ":" in ip else ip
            for port in self._selection.ports:
                items.append({"replica_id": f"{host}:{port}", "url": f"http://{host}:{port}"})
        return build_replicas(items, self._state_source, self.spec)

    # --- the requests ---------------------------------------------------------------------
    def _server(self) -> ApiServer:
        if self._api is None:
            self._api = ApiServer.from_env()
        if self._namespace is None:
            self._namespace = self._api.namespace()
        return self._api

    def _pool_path(self, api: str) -> str:
        return f"/apis/{api}/namespaces/{self._namespace}/inferencepools/{self.pool}"

    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self._namespace}/pods"

    def _described(self) -> str:
        return f"{self.spec}: InferencePool {self._namespace}/{self.pool}"

    def _not_found(self) -> ValueError:
        return ValueError(f"{self._described()} not found (looked in {' and '.join(POOL_APIS)})")

    def _refused(self, what: str, exc: ApiError) -> ValueError:
        hint = (" (the service account needs get/watch on inferencepools and list/watch on "
                "pods: deploy/kubernetes/kvguard-epp.yaml's Role)"
                if exc.status in (401, 403) else "")
        return ValueError(f"{self.spec}: {what}: {exc}{hint}")

    def _pool_answer(self, response: httpx.Response, api: str) -> PoolSpec | None:
        """The pool from a GET of it under ``api``; None: not there (404)."""
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise _error_of(response, response.content)
        return pool_spec(response.json(), api, self._described())

    def _read_once(self) -> None:
        """One GET of the pool and one list of its pods, blocking (start-up, before the
        event loop serves anything); every failure a ValueError that names this source."""
        try:
            server = self._server()
            with httpx.Client(**server.client_options()) as client:
                selection = None
                for api in POOL_APIS:
                    try:
                        selection = self._pool_answer(
                            client.get(self._pool_path(api), headers=server.headers()), api)
                    except ApiError as exc:
                        raise self._refused("cannot read the InferencePool", exc) from None
                    if selection is not None:
                        break
                if selection is None:
                    raise self._not_found()
                response = client.get(self._pods_path(), headers=server.headers(),
                                      params={"labelSelector": selection.label_selector()})
                if response.status_code != 200:
                    raise self._refused("cannot list the pool's pods",
                                        _error_of(response, response.content))
                self._selection = selection
                self._set_pods(response.json().get("items") or [])
        except httpx.HTTPError as exc:
            raise ValueError(f"{self.spec}: cannot reach the Kubernetes API at "
                             f"{self._api.url if self._api else '?'}: {exc}") from None
        except ValueError as exc:
            if str(exc).startswith(self.spec):
                raise
            raise ValueError(f"{self.spec}: {exc}") from None

    # --- following the pool ---------------------------------------------------------------
    async def follow(self) -> None:
        """Keep the pool's Ready pods current until cancelled (module docstring)."""
        while True:
            try:
                async with httpx.AsyncClient(**self._server().client_options()) as client:
                    while True:  # one round per selection of the pool
                        await self._follow_selection(client, await self._get_pool(client))
            except (ApiError, ValueError, KeyError, TypeError, httpx.HTTPError,
                    OSError) as exc:
                await self._back_off(f"{type(exc).__name__}: {exc}")

    async def _follow_selection(self, client: httpx.AsyncClient, selection: PoolSpec) -> None:
        """Follow the pods ``selection`` selects until the pool selects differently (return)
        or a watch fails (raise)."""
        if self._selection is not None and not self._selection.same_selection(selection):
            log.info("%s: the pool now selects %s on ports %s", self.spec,
                     selection.label_selector(), ",".join(map(str, selection.ports)))
        pods = asyncio.ensure_future(self._follow_pods(client, selection))
        pool = asyncio.ensure_future(self._watch_pool(client, selection))
        try:
            done, _ = await asyncio.wait((pods, pool), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pods, pool):
                task.cancel()
            await asyncio.gather(pods, pool, return_exceptions=True)
        for task in done:
            task.result()  # a watch's failure is this round's

    async def _get_pool(self, client: httpx.AsyncClient) -> PoolSpec:
        for api in POOL_APIS:
            response = await client.get(self._pool_path(api), headers=self._server().headers())
            selection = self._pool_answer(response, api)
            if selection is not None:
                return selection
        raise self._not_found()

    async def _follow_pods(self, client: httpx.AsyncClient, selection: PoolSpec) -> None:
        """List the pool's pods, then watch them; relist on 410, resume after a drop."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list_pods(client, selection)
                async for event in self._watch(client, self._pods_path(),
                                               {"labelSelector": selection.label_selector()},
                                               version):
                    version = event["object"]["metadata"].get("resourceVersion") or version
                    if event["type"] != "BOOKMARK":
                        self._pod_event(event["type"], event["object"])
            except Gone:
                log.info("%s: pods resourceVersion %s expired (410): listing again", self.spec,
                         version)
                version = None
            except httpx.TransportError as exc:
                await self._back_off(f"pod watch dropped ({type(exc).__name__}): resuming")

    async def _list_pods(self, client: httpx.AsyncClient, selection: PoolSpec) -> str:
        """List the pods ``selection`` selects: they, on its ports, are the replicas now."""
        response = await client.get(self._pods_path(), headers=self._server().headers(),
                                    params={"labelSelector": selection.label_selector()})
        if response.status_code != 200:
            raise _error_of(response, response.content)
        listing = response.json()
        reselected = self._selection is None or not self._selection.same_selection(selection)
        self._selection = selection  # with its pods, at once: never old pods on new ports
        self._set_pods(listing.get("items") or [], force=reselected)
        return str(listing.get("metadata", {}).get("resourceVersion", ""))

    async def _watch_pool(self, client: httpx.AsyncClient, selection: PoolSpec) -> None:
        """Return once the pool selects differently; ValueError once it is deleted."""
        path = self._pool_path(selection.api).rsplit("/", 1)[0]
        version = selection.resource_version
        while True:
            try:
                async for event in self._watch(client, path,
                                               {"fieldSelector": f"metadata.name={self.pool}"},
                                               version):
                    version = event["object"]["metadata"].get("resourceVersion") or version
                    if event["type"] == "DELETED":
                        raise ValueError(f"{self.spec}: the InferencePool was deleted; the "
                                         "replicas stay as they were")
                    if event["type"] in ("ADDED", "MODIFIED"):
                        new = pool_spec(event["object"], selection.api, self._described())
                        if not new.same_selection(selection):
                            return
            except Gone:
                new = await self._get_pool(client)
                if not new.same_selection(selection):
                    return
                version = new.resource_version
            except httpx.TransportError as exc:
                await self._back_off(f"pool watch dropped ({type(exc).__name__}): resuming")

    async def _back_off(self, reason: str) -> None:
        """Log ``reason`` (once while it repeats) and wait: 0.1 s after the first failure since
        a watch was last accepted, doubling up to MAX_BACKOFF_S."""
        self._failures += 1
        if reason != self._last_problem:
            self._last_problem = reason
            log.warning("replicas_from %s: %s (the replicas stay as they were; retrying)",
                        self.spec, reason)
        await asyncio.sleep(min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._failures - 1)))

    async def _watch(self, client: httpx.AsyncClient, path: str, params: dict[str, str],
                     version: str) -> AsyncIterator[dict[str, Any]]:
        """The watch events from ``version`` on, until the server ends the stream; Gone on
        410 (as the answer or as an ERROR event), ApiError on another refusal."""
        params = {**params, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=WATCH_TIMEOUT_S + 30)
        async with client.stream("GET", path, params=params, headers=self._server().headers(),
                                 timeout=timeout) as response:
            if response.status_code != 200:
                raise _error_of(response, await response.aread())
            self._failures = 0  # accepted: the next failure starts the backoff anew
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    code = status.get("code", 500)
                    raise (Gone if code == 410 else ApiError)(code, status.get("message", ""))
                yield event

    # --- the pod set ----------------------------------------------------------------------
    def _set_pods(self, pods: list[dict[str, Any]], force: bool = False) -> None:
        self._pods = {pod["metadata"]["name"]: ready_ip(pod) for pod in pods}
        self._pods_changed(force)

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods[name] = ready_ip(pod)
        self._pods_changed()

    def _pods_changed(self, force: bool = False) -> None:
        ips = tuple(sorted({ip for ip in self._pods.values() if ip}, key=_ip_key))
        if ips != self._ips or force:
            self._ips = ips
            self._version += 1
            self.updated.set()
        self._last_problem = None
