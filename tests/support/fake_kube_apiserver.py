"""A small real HTTP(S) server on 127.0.0.1 that stands in for kube-apiserver in tests: it keeps
Pods and InferencePools and answers, in the Kubernetes wire format, what
:mod:`guard.replicas.inference_pool` asks of the real one.

* ``GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...``: a PodList with
  ``metadata.resourceVersion``;
* ``GET /apis/GROUP/VERSION/namespaces/NS/inferencepools/NAME``: the pool, or a 404 Status;
* either collection with ``watch=1&resourceVersion=RV`` (pools: ``fieldSelector=metadata.name=X``):
  a chunked stream, one JSON event per line (``{"type": "ADDED"|"MODIFIED"|"DELETED", "object":
  ...}``) for every change after RV, then each new one as it happens; an RV older than the last
  :meth:`FakeKubeApiServer.compact` gets the ``ERROR`` event with a 410 Status, as the real one
  sends once etcd compacted it away;
* a bearer token not in :attr:`FakeKubeApiServer.tokens` gets a 401 Status.

:meth:`FakeKubeApiServer.drop_watches` cuts every open watch mid-stream (no final chunk), as a
restarting API server or a lost connection does. Every request is recorded in ``requests``.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

__all__ = ["FakeKubeApiServer", "Request", "self_signed_tls", "service_account", "pod", "pool_v1",
           "pool_v1alpha2"]

V1 = "inference.networking.k8s.io/v1"
V1ALPHA2 = "inference.networking.x-k8s.io/v1alpha2"


def pod(name: str, ip: str | None, ready: bool = True, labels: dict[str, str] | None = None,
        *, deleting: bool = False) -> dict[str, Any]:
    """A Pod object as the API server returns it (resourceVersion filled in when stored)."""
    metadata: dict[str, Any] = {"name": name, "labels": labels or {"app": "vllm"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-06T10:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def pool_v1(name: str, labels: dict[str, str] | None, ports: list[int]) -> dict[str, Any]:
    spec: dict[str, Any] = {"targetPorts": [{"number": p} for p in ports],
                            "endpointPickerRef": {"name": "kvguard-epp", "port": {"number": 9002}}}
    if labels is not None:
        spec["selector"] = {"matchLabels": labels}
    return {"apiVersion": V1, "kind": "InferencePool", "metadata": {"name": name}, "spec": spec}


def pool_v1alpha2(name: str, labels: dict[str, str], port: int) -> dict[str, Any]:
    return {"apiVersion": V1ALPHA2, "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"selector": labels, "targetPortNumber": port,
                     "extensionRef": {"name": "kvguard-epp"}}}


def self_signed_tls(folder: Path) -> tuple[ssl.SSLContext, Path] | None:
    """A server TLS context for 127.0.0.1 and the certificate a client trusts it by (its
    ca.crt); None without the openssl command."""
    if shutil.which("openssl") is None:
        return None
    cert, key = folder / "ca.crt", folder / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


def service_account(tmp_path: Path) -> tuple[Path, tuple[ssl.SSLContext, Path]]:
    """A pod's service-account folder under ``tmp_path`` (token ``token-1``, namespace
    ``default``, the API server's ca.crt) and the server's TLS; the test is skipped without
    the openssl command."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    tls = self_signed_tls(account)
    if tls is None:
        pytest.skip("needs the openssl command for the API server's certificate")
    (account / "token").write_text("token-1")
    (account / "namespace").write_text("default")
    return account, tls


class Request:
    """One request as the server saw it."""

    def __init__(self, path: str, query: dict[str, str], token: str | None) -> None:
        self.path, self.query, self.token = path, query, token

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("1", "true")

    def __repr__(self) -> str:
        return f"Request({self.path!r}, {self.query!r}, token={self.token!r})"


class FakeKubeApiServer:
    """Use as a context manager; ``url`` is where it listens (https with ``tls``)."""

    def __init__(self, tls: ssl.SSLContext | None = None, namespace: str = "default") -> None:
        self.namespace = namespace
        self.tokens = {"token-1"}
        self.requests: list[Request] = []
        self._cond = threading.Condition()
        self._rv = 100
        self._compacted_rv = 0
        self._drops = 0
        self._compactions = 0
        self._open_watches: list[str] = []  # the paths of the watches a drop or compaction reaches
        self._stopping = False
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}  # (collection, name) -> obj
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # rv, collection, type, obj
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        port = self._server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.port = port
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    def __enter__(self) -> FakeKubeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # --- what a test changes --------------------------------------------------------------
    def put_pod(self, obj: dict[str, Any]) -> None:
        self._put("pods", obj)

    def delete_pod(self, name: str) -> None:
        self._delete("pods", name)

    def put_pool(self, obj: dict[str, Any]) -> None:
        self._put(f"pools:{obj['apiVersion']}", obj)

    def delete_pool(self, api: str, name: str) -> None:
        self._delete(f"pools:{api}", name)

    def compact(self) -> None:
        """Forget the history so far: a watch from an older resourceVersion is 410 Gone, and
        every open watch ends with the ERROR event that says so (as when the real one's watch
        cache is reset)."""
        with self._cond:
            self._compacted_rv = self._rv
            self._events.clear()
            self._compactions += 1
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch stream mid-body."""
        with self._cond:
            self._drops += 1
            self._cond.notify_all()

    def watches(self, path_part: str) -> list[Request]:
        return [r for r in self.requests if r.is_watch and path_part in r.path]

    def open_watches(self, path_part: str) -> list[str]:
        """The watches under way: past their first look at the history, so a drop or a
        compaction from now on reaches them (one merely asked for may not have looked yet)."""
        with self._cond:
            return [p for p in self._open_watches if path_part in p]

    def lists(self, path_part: str) -> list[Request]:
        return [r for r in self.requests if not r.is_watch and path_part in r.path]

    def _put(self, collection: str, obj: dict[str, Any]) -> None:
        obj = json.loads(json.dumps(obj))
        with self._cond:
            self._rv += 1
            obj["metadata"]["namespace"] = self.namespace
            obj["metadata"]["resourceVersion"] = str(self._rv)
            key = (collection, obj["metadata"]["name"])
            kind = "MODIFIED" if key in self._objects else "ADDED"
            self._objects[key] = obj
            self._events.append((self._rv, collection, kind, obj))
            self._cond.notify_all()

    def _delete(self, collection: str, name: str) -> None:
        with self._cond:
            obj = self._objects.pop((collection, name))
            self._rv += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._rv)}}
            self._events.append((self._rv, collection, "DELETED", obj))
            self._cond.notify_all()

    # --- serving --------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake._serve(self)

        return Handler

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        auth = handler.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        with self._cond:
            self.requests.append(Request(url.path, query, token))
        if token not in self.tokens:
            return self._status(handler, 401, "Unauthorized")
        parts = url.path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["pods"]:
            collection, name = "pods", None
        elif (parts[:1] == ["apis"] and parts[3:4] == ["namespaces"]
              and parts[5:6] == ["inferencepools"] and len(parts) in (6, 7)):
            collection = f"pools:{parts[1]}/{parts[2]}"
            name = parts[6] if len(parts) == 7 else None
        else:
            return self._status(handler, 404, f"the server could not find {url.path}")
        if parts[3 if parts[0] == "api" else 4] != self.namespace:
            return self._status(handler, 404, "no such namespace here")
        labels = dict(p.split("=", 1) for p in query.get("labelSelector", "").split(",") if p)
        field = query.get("fieldSelector", "")
        wanted = field.removeprefix("metadata.name=") if field else None

        def matches(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            return (all(meta.get("labels", {}).get(k) == v for k, v in labels.items())
                    and (wanted is None or meta["name"] == wanted))

        if name is not None:
            with self._cond:
                obj = self._objects.get((collection, name))
            if obj is None:
                return self._status(handler, 404, f"inferencepools {name!r} not found")
            return self._json(handler, 200, obj)
        if query.get("watch") in ("1", "true"):
            return self._watch(handler, url.path, collection,
                               int(query.get("resourceVersion") or 0), matches)
        with self._cond:
            items = [o for (c, _), o in self._objects.items() if c == collection and matches(o)]
            rv = str(self._rv)
        return self._json(handler, 200, {"kind": "List", "apiVersion": "v1",
                                         "metadata": {"resourceVersion": rv}, "items": items})

    def _watch(self, handler: BaseHTTPRequestHandler, path: str, collection: str, since: int,
               matches: Any) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()

        def gone() -> None:
            send({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                "reason": "Expired", "message": "too old resource version"}})
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()

        with self._cond:
            drops, compactions = self._drops, self._compactions
            if since < self._compacted_rv:
                pending = None
            else:
                pending = [(rv, kind, obj) for rv, c, kind, obj in self._events
                           if rv > since and c == collection and matches(obj)]
                since = self._rv
                self._open_watches.append(path)
        if pending is None:
            gone()
            return
        try:
            try:
                while True:
                    for _, kind, obj in pending:
                        send({"type": kind, "object": obj})
                    with self._cond:
                        while (self._rv == since and self._drops == drops
                               and self._compactions == compactions and not self._stopping):
                            self._cond.wait()
                        if self._compactions != compactions:
                            return gone()
                        if self._drops != drops or self._stopping:
                            break
                        pending = [(rv, kind, obj) for rv, c, kind, obj in self._events
                                   if rv > since and c == collection and matches(obj)]
                        since = self._rv
            except OSError:
                return
            handler.close_connection = True
            try:  # cut: no final chunk, the client sees the body end early
                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        finally:
            with self._cond:
                self._open_watches.remove(path)

    def _json(self, handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _status(self, handler: BaseHTTPRequestHandler, code: int, message: str) -> None:
        self._json(handler, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "message": message, "code": code})
