"""The proxy on kvguard's own server decides an admitted request and writes it to its replica
from the server's read callback (``ProxyApp.http_direct``): no ASGI scope and no task exist
before the request is on its way upstream; what is left runs in the request's task. A real
upstream process, the proxy in-process on ``serving.h1server`` over loopback."""

import asyncio
import contextlib
from collections.abc import Iterator

from proxy_helpers import running, upstream_child

from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from guard.proxy.h1_transport import H1Transport
from serving import ServerLimits
from serving.limited_protocol import ConnectionTable
from tests.support.loopback import H1LoopbackServer

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 8}


class RecordedTransport(H1Transport):
    """The h1 client, recording each ``send_now`` (whether a task was running, whether the
    request was written there and then)."""

    def __init__(self) -> None:
        super().__init__(connect_timeout_s=5.0, read_timeout_s=30.0,
                         max_connections_per_replica=8)
        self.sends: list[tuple[bool, bool]] = []
        self.controller = None  # the proxy's controller, once the app is built
        self.held_at_write: list[int] = []  # tickets held when a request was written
        self.booked_at_write: list[bool] = []  # whether its reservation was made by then

    def send_now(self, url, headers, body, request_id=None):
        if self.controller is not None:  # before the write: is the request booked?
            self.booked_at_write.append(
                self.controller.load_state.reservation(request_id) is not None)
            self.held_at_write.append(self.controller.tickets.num_held)
        written = super().send_now(url, headers, body, request_id)
        self.sends.append((asyncio.current_task() is None, written is not None))
        return written


class Recorded(ProxyApp):
    """The proxy on that client, recording what reached it through ASGI and what its direct
    handler returned."""

    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config, transport=RecordedTransport())
        self.transport.controller = self.controller
        self.asgi_paths: list[str] = []
        self.sends = self.transport.sends
        self.held_at_write = self.transport.held_at_write
        self.booked_at_write = self.transport.booked_at_write
        self.direct: list[str] = []  # what http_direct returned: asgi, answered or task

    def http_direct(self, request, exchange):
        rest = super().http_direct(request, exchange)
        self.direct.append("asgi" if rest is None else "answered" if rest is True else "task")
        return rest

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.asgi_paths.append(scope["path"])
        return await super().__call__(scope, receive, send)


@contextlib.contextmanager
def _recorded_proxy() -> Iterator[tuple[Recorded, str]]:
    """The recorded proxy (``always_admit``) on kvguard's server in front of one ``ok``
    upstream process: (the app, the proxy's URL)."""
    with running(upstream_child("ok")) as upstream:
        config = GuardConfig.from_dict({"policy": "always_admit", "replicas": [
            {"replica_id": "r0", "url": upstream.url, "state_source": "none",
             "models": [BODY["model"]]}]})  # listed: no /v1/models read opens a connection
        app = Recorded(config)
        with H1LoopbackServer(app, ConnectionTable(ServerLimits())) as proxy:
            yield app, proxy.url


def test_admitted_requests_are_written_upstream_from_the_read_callback(client):
    with _recorded_proxy() as (app, url):
        for stream in (False, True, False, True):
            response = client.post(url + "/v1/completions",
                                   json={**BODY, "stream": stream})
            assert response.status_code == 200, response.text
            assert response.headers["x-kvguard-replica"] == "r0"
            if stream:
                assert response.text.rstrip().endswith("data: [DONE]")
            else:
                assert response.json()["usage"]["completion_tokens"] > 0
        bad = client.post(url + "/v1/completions", content=b'{"prompt": ')
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        assert client.get(url + "/health").status_code == 200
        assert app.num_in_flight == 0
    # every admitted POST was decided outside ASGI (the 400 answered there and then, no task);
    # only the GET went through it
    assert app.direct == ["task"] * 4 + ["answered", "asgi"]
    assert app.asgi_paths == ["/health"]
    # each one reached send_now from the read callback (no task yet); the first found no
    # pooled connection (forward() connected), the others were written there and then
    assert [in_callback for in_callback, _ in app.sends] == [True] * 4
    assert [written for _, written in app.sends] == [False, True, True, True]


def test_the_request_is_booked_when_it_is_written_upstream(client):
    """From the read callback the decided request is booked (its reservation, and its ticket:
    one request at a time, so exactly one ticket is held) before it goes upstream, so no
    later decision can take its capacity; every request is released at the end."""
    with _recorded_proxy() as (app, url):
        for stream in (False, True, True, False):
            response = client.post(url + "/v1/completions",
                                   json={**BODY, "stream": stream})
            assert response.status_code == 200, response.text
            assert float(response.headers["x-kvguard-queue-ms"]) >= 0
        # (a round trip after the last response: its release ran after its last write)
        state = client.get(url + "/kvguard/state").json()
        assert app.num_in_flight == 0
        assert state["replicas"][0]["num_inflight"] == 0
        assert state["replicas"][0]["num_reserved_blocks"] == 0
    assert app.held_at_write == [1, 1, 1, 1]
    assert app.booked_at_write == [True] * 4
    assert [written for _, written in app.sends] == [False, True, True, True]


def test_the_cpu_is_yielded_once_after_the_last_write_and_before_the_release(client,
                                                                             monkeypatch):
    """Once a response's last bytes are written to the client, the proxy yields its CPU once
    (a client the write woke on the same core runs before the proxy's bookkeeping); the ticket
    is released only after. Streamed (pushed from the read callback) and JSON answers alike."""
    from guard.proxy import upstream as forwarding
    from serving.h1_connection import H1Connection

    events: list[tuple[str, object]] = []
    write = H1Connection.write

    def recorded_write(conn, data):
        events.append(("write", bytes(data)))
        write(conn, data)

    monkeypatch.setattr(H1Connection, "write", recorded_write)
    with running(upstream_child("ok")) as upstream:
        config = GuardConfig.from_dict({"policy": "always_admit", "replicas": [
            {"replica_id": "r0", "url": upstream.url, "state_source": "none",
             "models": [BODY["model"]]}]})  # listed: no /v1/models read opens a connection
        app = Recorded(config)
        monkeypatch.setattr(forwarding, "yield_cpu",
                            lambda: events.append(("yield", app.num_in_flight)))
        with H1LoopbackServer(app, ConnectionTable(ServerLimits())) as proxy:
            for stream in (True, False, True):
                events.clear()
                response = client.post(proxy.url + "/v1/completions",
                                       json={**BODY, "stream": stream})
                assert response.status_code == 200, response.text
                assert proxy.call(_settled(app))
                yields = [i for i, (kind, _) in enumerate(events) if kind == "yield"]
                assert len(yields) == 1, events  # once per response
                at = yields[0]
                assert events[at][1] == 1  # before the release: the request still in flight
                kind, last = events[at - 1]  # right after the write that ended the response
                assert kind == "write"
                if stream:
                    assert last.endswith(b"0\r\n\r\n")
                else:
                    assert last.endswith(response.content)
                assert all(kind == "write" for kind, _ in events[:at])


async def _settled(app) -> bool:
    """True once nothing is in flight (the release runs after the response went out)."""
    for _ in range(200):
        if app.num_in_flight == 0:
            return True
        await asyncio.sleep(0.01)
    return False
