"""The h1 upstream client against real HTTP/1.1 servers on loopback (asyncio servers in the
test's own loop, each answering as the test scripts it): framing, pooling, timeouts, faults.

Timeouts here are small so that failures show quickly; no assertion is about how long
anything took (``wait_for`` bounds are hang guards)."""

import asyncio
import shutil
import socket
import ssl
import subprocess

import pytest

from chaos.ports import free_port
from guard.proxy import h1_connection
from guard.proxy.h1_transport import H1Transport
from guard.proxy.transports import (
    UpstreamBroken,
    UpstreamMalformed,
    UpstreamTimeout,
    UpstreamUnreachable,
    make_transport,
)
from tests.support.self_connect import connects_to_itself

JSON = [(b"content-type", b"application/json")]
HANG_GUARD_S = 20.0


class Server:
    """A loopback server: each request's (head, body) is recorded per connection and answered by
    ``answer(server, conn_index, request_index, head, writer)``, which returns False to close."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections: list[list[tuple[bytes, bytes]]] = []
        self.closed_by_peer: list[asyncio.Event] = []
        self.readers: list[asyncio.StreamReader] = []
        self.release = asyncio.Event()
        self._server = None
        self.url = ""

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self._server.close()

    async def _serve(self, reader, writer) -> None:
        index = len(self.connections)
        requests: list[tuple[bytes, bytes]] = []
        self.connections.append(requests)
        self.closed_by_peer.append(asyncio.Event())
        self.readers.append(reader)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_peer[index].set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                requests.append((head, body))
                if not await self.answer(self, index, len(requests) - 1, head, writer):
                    return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer[index].set()
        finally:
            writer.close()

    async def until_the_client_closes(self, conn: int) -> None:
        """Inside ``answer``: read (and drop) until the client closes connection ``conn``."""
        try:
            while await self.readers[conn].read(1 << 16):
                pass
        except ConnectionError:
            pass
        self.closed_by_peer[conn].set()

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.connections)


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra +
            b"content-length: %d\r\n\r\n" % len(body) + body)


async def answer_ok(server, conn, index, head, writer) -> bool:
    writer.write(ok())
    return True


def run(main):
    asyncio.run(asyncio.wait_for(main(), HANG_GUARD_S))


async def read_all(response) -> bytes:
    try:
        return b"".join([chunk async for chunk in response.chunks()])
    finally:
        await response.aclose()


def transport(**kwargs) -> H1Transport:
    values = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "max_connections_per_replica": 8}
    return H1Transport(**{**values, **kwargs})


def test_make_transport_builds_it():
    assert isinstance(make_transport("h1", 1.0, 2.0, 3, 1), H1Transport)


def test_post_is_framed_and_sequential_requests_share_a_kept_alive_connection():
    async def answer(server, conn, index, head, writer):
        writer.write(ok(b"x" * (index + 1), b"connection: keep-alive\r\nkeep-alive: timeout=5\r\n"
                        b"date: today\r\nserver: test\r\nx-request-id: r%d\r\n" % index))
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            for i in range(3):
                response = await client.send(server.url + "/v1/completions?q=1",
                                             [*JSON, (b"connection", b"close")], b'{"n": %d}' % i)
                assert response.status == 200
                assert response.headers == [(b"content-type", b"application/json"),
                                            (b"x-request-id", b"r%d" % i)]
                assert await read_all(response) == b"x" * (i + 1)
            assert await client.get(server.url + "/health", 2.0) == (200, b"x" * 4)
            await client.aclose()
        assert len(server.connections) == 1
        head, body = server.connections[0][0]
        port = server.url.rsplit(":", 1)[1]
        assert head == (b"POST /v1/completions?q=1 HTTP/1.1\r\nhost: 127.0.0.1:%s\r\n"
                        b"content-type: application/json\r\ncontent-length: 8\r\n\r\n"
                        % port.encode())
        assert body == b'{"n": 0}'
        assert server.connections[0][3][0].startswith(b"GET /health HTTP/1.1\r\n")
    run(main)


def test_a_chunked_stream_is_handed_on_as_it_arrives_not_at_its_end():
    events = [b"data: %d\n\n" % i for i in range(5)]
    taken = asyncio.Queue()

    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            assert await taken.get() == event  # the next one only once the client has this one
        writer.write(b"0\r\n\r\n")
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/v1/completions", JSON, b"{}")
            async for chunk in response.chunks():
                await taken.put(chunk)
            await response.aclose()
            again = await client.send(server.url + "/v1/completions", JSON, b"{}")
            async for chunk in again.chunks():
                await taken.put(chunk)
            await again.aclose()
            await client.aclose()
        assert len(server.connections) == 1  # read to the end: back to the pool
    run(main)


def test_ended_says_whether_the_chunk_just_taken_was_the_last():
    """The relay sends the last chunk with the end of the response when ``ended`` says so;
    a terminator that comes in a later read leaves it False until then."""
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await server.release.wait()
        if index == 0:  # the last chunk and the terminator in one write
            writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        else:  # the terminator on its own, later
            writer.write(b"4\r\nlast\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b"0\r\n\r\n")
        server.release.clear()
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(2):
                response = await client.send(server.url + "/v1/completions", JSON, b"{}")
                seen = []
                async for chunk in response.chunks():
                    seen.append((chunk, response.ended))
                    if chunk == b"first":
                        server.release.set()
                await response.aclose()
                assert seen[0] == (b"first", False)
                assert [c for c, _ in seen] == [b"first", b"last"]
                results.append(seen[-1][1])
            await client.aclose()

    results: list[bool] = []
    run(main)
    assert results == [True, False]


def test_chunked_framing_written_one_byte_at_a_time():
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"a" * 20, b"\r\n0\r\n", b"z")) \
        + b"0\r\n\r\n"

    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(len(body)):
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(2):
                response = await client.send(server.url + "/x", JSON, b"{}")
                assert await read_all(response) == b"a" * 20 + b"\r\n0\r\n" + b"z"
            await client.aclose()
        assert len(server.connections) == 1
    run(main)


def test_a_close_delimited_body_ends_at_close_and_its_connection_is_not_reused():
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(2):
                response = await client.send(server.url + "/x", JSON, b"{}")
                assert await read_all(response) == b"part one, part two"
            await client.aclose()
        assert [len(c) for c in server.connections] == [1, 1]
    run(main)


@pytest.mark.parametrize("reply, error", [
    (b"\x00\x01 this is not HTTP at all \r\n\r\n", UpstreamMalformed),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nxx", UpstreamMalformed),
    (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", UpstreamMalformed),
    (b"HTTP/1.1 20", UpstreamBroken),  # closed inside the head
])
def test_a_garbage_head_is_an_error_and_sent_once(reply, error):
    async def answer(server, conn, index, head, writer):
        if index == 0:
            writer.write(ok())
            return True
        writer.write(reply)
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            assert await client.get(server.url + "/health", 2.0) == (200, b'{"ok": true}')
            with pytest.raises(error):
                await client.send(server.url + "/x", JSON, b"{}")  # on the reused connection
            await client.aclose()
        assert server.num_requests == 2  # the request was written: never sent again
    run(main)


def test_silence_before_the_head_or_between_chunks_is_a_timeout():
    async def answer(server, conn, index, head, writer):
        if b"/chunk" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await server.until_the_client_closes(conn)
        return False

    async def main():
        async with Server(answer) as server:
            client = transport(read_timeout_s=0.2)
            with pytest.raises(UpstreamTimeout):
                await client.send(server.url + "/head", JSON, b"{}")
            response = await client.send(server.url + "/chunk", JSON, b"{}")
            chunks = []
            with pytest.raises(UpstreamTimeout):
                async for chunk in response.chunks():
                    chunks.append(chunk)
            assert chunks == [b"first"]
            await response.aclose()
            with pytest.raises(UpstreamTimeout):
                await transport(read_timeout_s=60.0).get(server.url + "/head", 0.2)
            for closed in server.closed_by_peer:  # every timed-out connection was closed
                await closed.wait()
            await client.aclose()
    run(main)


@pytest.mark.parametrize("framing", ["length", "chunked", "reset"])
def test_a_body_cut_mid_way_is_broken(framing):
    async def answer(server, conn, index, head, writer):
        if framing == "length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"a\r\nxxxxxxxxxx\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        if framing == "reset":
            writer.transport.abort()
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            received = []
            with pytest.raises(UpstreamBroken):
                async for chunk in response.chunks():
                    received.append(chunk)
            assert b"".join(received) == b"x" * 10
            await response.aclose()
            await client.aclose()
    run(main)


def test_a_bad_chunk_size_mid_body_is_malformed():
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n")
        await server.until_the_client_closes(conn)
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            with pytest.raises(UpstreamMalformed):
                await read_all(response)
            await server.closed_by_peer[0].wait()
            await client.aclose()
    run(main)


async def answer_but_close_at_the_second(server, conn, index, head, writer) -> bool:
    """The first connection closes as its second request arrives, without a byte of answer."""
    if conn == 0 and index == 1:
        return False
    writer.write(ok())
    return True


def test_a_request_the_upstream_read_and_closed_on_is_never_sent_again():
    async def main():
        async with Server(answer_but_close_at_the_second) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            assert await read_all(response) == b'{"ok": true}'
            with pytest.raises(UpstreamBroken) as raised:  # RFC 9110 9.2.2: it may have acted
                await client.send(server.url + "/x", JSON, b"{}")
            assert not isinstance(raised.value, UpstreamMalformed)
            response = await client.send(server.url + "/x", JSON, b"{}")  # a fresh one
            assert await read_all(response) == b'{"ok": true}'
            await client.aclose()
        assert [len(c) for c in server.connections] == [2, 1]
    run(main)


def test_a_fresh_connection_closed_before_any_byte_is_broken_and_not_retried():
    async def answer(server, conn, index, head, writer):
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(2):
                with pytest.raises(UpstreamBroken):
                    await client.send(server.url + "/x", JSON, b"{}")
            await client.aclose()
        assert server.num_requests == 2
    run(main)


def test_a_pooled_connection_closed_before_the_write_is_replaced_by_a_fresh_one():
    closes: list[asyncio.Event] = []

    async def answer(server, conn, index, head, writer):
        writer.write(ok())  # keep-alive by the headers, then closed anyway
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closes[conn].set()
        return False

    async def main():
        async with Server(answer) as server:
            client = transport()
            for i in range(10):
                closes.append(asyncio.Event())
                response = await client.send(server.url + "/x", JSON, b"{}")
                assert await read_all(response) == b'{"ok": true}'
                await closes[i].wait()  # its close is sent (maybe not read by the client yet)
            await client.aclose()
        # each request on a connection of its own, each sent once
        assert server.num_requests == len(server.connections) == 10
    run(main)


def test_leaving_a_response_early_closes_its_connection_at_once():
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await server.until_the_client_closes(conn)
        return False

    async def main():
        async with Server(answer) as server:
            client = transport(keepalive_s=600.0)  # no idle sweep could close it instead
            response = await client.send(server.url + "/x", JSON, b"{}")
            async for chunk in response.chunks():
                assert chunk == b"first"
                break
            await response.aclose()
            await server.closed_by_peer[0].wait()  # the upstream sees its client go
            unread = await client.send(server.url + "/x", JSON, b"{}")
            await unread.aclose()  # not even the first chunk read
            await server.closed_by_peer[1].wait()
            await client.aclose()
        assert [len(c) for c in server.connections] == [1, 1]
    run(main)


def test_a_complete_body_left_unread_still_returns_its_connection():
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 7\r\n"
                     b"content-length: 2\r\n\r\n{}")
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(3):
                response = await client.send(server.url + "/x", JSON, b"{}")
                assert response.status == 503 and (b"retry-after", b"7") in response.headers
                await asyncio.sleep(0.01)  # the 2-byte body is in (it came with the head)
                await response.aclose()
            await client.aclose()
        assert len(server.connections) == 1
    run(main)


def test_connections_per_replica_are_capped():
    async def answer(server, conn, index, head, writer):
        await server.release.wait()
        writer.write(ok())
        return True

    async def main():
        async with Server(answer) as server:
            client = transport(max_connections_per_replica=2)

            async def one():
                return await read_all(await client.send(server.url + "/x", JSON, b"{}"))

            tasks = [asyncio.ensure_future(one()) for _ in range(5)]
            while server.num_requests < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert len(server.connections) == 2 and server.num_requests == 2
            server.release.set()
            assert await asyncio.gather(*tasks) == [b'{"ok": true}'] * 5
            await client.aclose()
        assert len(server.connections) == 2 and server.num_requests == 5
    run(main)


def test_idle_connections_are_closed_after_keepalive_s():
    async def main():
        async with Server(answer_ok) as server:
            client = transport(keepalive_s=0.05)
            assert (await client.get(server.url + "/a", 2.0))[0] == 200
            await server.closed_by_peer[0].wait()  # closed by the pool's sweep
            assert (await client.get(server.url + "/b", 2.0))[0] == 200
            expired = transport(keepalive_s=0.0)  # expired when next taken: a new connection
            for _ in range(2):
                assert (await expired.get(server.url + "/c", 2.0))[0] == 200
            await client.aclose()
            await expired.aclose()
        assert [len(c) for c in server.connections] == [1, 1, 1, 1]
    run(main)


def test_a_slow_consumer_pauses_reading_from_the_upstream():
    size = 8 << 20

    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size >> 16):
            writer.write(b"y" * (1 << 16))
            await writer.drain()
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            conn = response._conn
            while conn.transport.is_reading():  # the server keeps writing, nobody reads
                await asyncio.sleep(0.01)
            # what one read can add past the bound (asyncio reads up to 256 KiB at a time)
            assert conn._num_pending_bytes <= h1_connection.HIGH_WATER_BYTES + (256 << 10)
            assert len(await read_all(response)) == size
            await client.aclose()
    run(main)


def test_push_hands_the_body_on_from_the_read_callback_and_stops_reading_when_asked():
    """``push(sink)``: every piece in order with ``last`` on the final one; a sink that calls
    ``stop_push`` gets nothing more and reading from the upstream pauses until the next push."""
    size = 4 << 20

    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(size >> 16):
            writer.write(b"10000\r\n" + b"z" * (1 << 16) + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            got: list[tuple[int, bool]] = []
            in_sink: list[bool] = []

            def sink(data: bytes, last: bool) -> None:
                in_sink.append(asyncio.current_task() is None)  # the protocol's callback
                got.append((len(data), last))
                if sum(n for n, _ in got) >= size // 2 and len(got) < 10_000:
                    response.stop_push()

            assert await response.push(sink) is False  # stopped half-way
            conn = response._conn
            taken = len(got)
            while conn.transport.is_reading():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert len(got) == taken  # nothing handed on while stopped
            got.append((0, False))  # from here on the sink never stops
            more = got[:]

            def rest(data: bytes, last: bool) -> None:
                more.append((len(data), last))

            assert await response.push(rest) is True
            assert sum(n for n, _ in more) == size
            assert not any(last for _, last in more[:-1])  # only the final piece may end it
            assert any(in_sink)
            await response.aclose()
            await client.aclose()
        assert len(server.connections) == 1
    run(main)


def test_push_ends_the_body_from_the_read_callback_when_the_terminator_arrives_alone():
    """An upstream that writes its last chunk and the chunked terminator apart (uvicorn and
    kvguard's engine do: the final empty ``http.response.body`` is its own write): the sink
    still gets ``last`` from the protocol's callback, an empty piece, so the client's body
    ends there and not in the consumer's task after a wake-up."""
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"e\r\ndata: [DONE]\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # read apart from the chunk before it
        writer.write(b"0\r\n\r\n")
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            got: list[tuple[bytes, bool, bool]] = []

            def sink(data: bytes, last: bool) -> None:
                got.append((data, last, asyncio.current_task() is None))

            assert await response.push(sink) is True
            assert b"".join(data for data, _, _ in got) == b"data: [DONE]\n\n"
            assert got[-1] == (b"", True, True)  # the end, from the protocol's callback
            assert not any(last for _, last, _ in got[:-1])
            assert response._conn.body_complete and response._conn.keep_alive
            await response.aclose()
            await client.aclose()
    run(main)


def test_an_interim_100_head_is_skipped():
    async def answer(server, conn, index, head, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok())
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            response = await client.send(server.url + "/x", JSON, b"{}")
            assert response.status == 200 and await read_all(response) == b'{"ok": true}'
            await client.aclose()
    run(main)


def test_a_refused_connect_is_unreachable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connects are refused

        async def main():
            client = transport()
            with pytest.raises(UpstreamUnreachable):
                await client.send(f"http://127.0.0.1:{port}/x", JSON, b"{}")
            with pytest.raises(UpstreamUnreachable):
                await client.get(f"http://127.0.0.1:{port}/health", 1.0)
            await client.aclose()
        run(main)


def test_a_connection_that_reaches_itself_is_refused_and_its_port_freed_at_once():
    """Nothing listens on the replica's port and the kernel gives the connection that port as
    its own: it is connected to itself. It is refused as unreachable (not read as its own echo),
    its pool slot is free, and the replica can bind its port again straight away."""
    port = free_port()

    async def main():
        client = transport(max_connections_per_replica=1)
        with connects_to_itself(asyncio.get_running_loop(), port):
            with pytest.raises(UpstreamUnreachable, match="reached itself"):
                await client.send(f"http://127.0.0.1:{port}/x", JSON, b"{}")
            with pytest.raises(UpstreamUnreachable, match="reached itself"):
                await client.get(f"http://127.0.0.1:{port}/health", 1.0)
        assert all(p.num_open == 0 for p in client._pools.values())
        server = Server(answer_ok)
        server._server = await asyncio.start_server(server._serve, "127.0.0.1", port)
        try:  # the port was free again, and the one slot is usable
            response = await client.send(f"http://127.0.0.1:{port}/x", JSON, b"{}")
            assert response.status == 200 and await read_all(response) == b'{"ok": true}'
        finally:
            server._server.close()
            await client.aclose()
    run(main)


@pytest.mark.parametrize("reply", [ok(extra=b"connection: close\r\n"),
                                   ok().replace(b"HTTP/1.1", b"HTTP/1.0"),
                                   ok(b"{}") + b"extra bytes after the body"])
def test_a_connection_the_answer_says_not_to_reuse_is_not_reused(reply):
    async def answer(server, conn, index, head, writer):
        writer.write(reply)  # and the socket stays open
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            for _ in range(2):
                response = await client.send(server.url + "/x", JSON, b"{}")
                assert response.status == 200
                await read_all(response)
            await client.aclose()
        assert [len(c) for c in server.connections] == [1, 1]
    run(main)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_replicas_are_verified_against_the_default_ca_store(tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)

    async def main(expect_ok: bool):
        server = await asyncio.start_server(
            lambda r, w: Server(answer_ok)._serve(r, w), "127.0.0.1", 0, ssl=server_tls)
        url = f"https://localhost:{server.sockets[0].getsockname()[1]}/health"
        client = transport()
        try:
            if expect_ok:
                assert await client.get(url, 5.0) == (200, b'{"ok": true}')
            else:
                with pytest.raises(UpstreamUnreachable):
                    await client.get(url, 5.0)
        finally:
            await client.aclose()
            server.close()

    run(lambda: main(expect_ok=False))  # a certificate nobody vouches for is refused
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the default store now trusts it
    run(lambda: main(expect_ok=True))


def test_a_connect_that_never_completes_is_unreachable_after_connect_timeout_s():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: once its queue is full, new SYNs are dropped
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
                fillers.append(filler)

            async def main():
                client = transport(connect_timeout_s=0.3)
                with pytest.raises(UpstreamUnreachable, match="timed out"):
                    await client.send(f"http://127.0.0.1:{port}/x", JSON, b"{}")
                assert client._pools and all(p.num_open == 0 for p in client._pools.values())
                await client.aclose()
            run(main)
        finally:
            for filler in fillers:
                filler.close()


def test_send_now_writes_on_an_idle_pooled_connection_before_anything_awaits_it():
    """``send_now`` (the proxy's read-callback path): with an idle pooled connection the request
    is written before the call returns — the upstream has it before the caller waits on
    anything — and awaiting the result gives the response, the connection going back to the
    pool; with none idle (or an unusable URL) it writes nothing and says None."""
    seen = asyncio.Event()

    async def answer(server, conn, index, head, writer):
        seen.set()
        writer.write(ok(b"%d" % index))
        return True

    async def main():
        async with Server(answer) as server:
            client = transport()
            assert client.send_now(server.url + "/x", JSON, b"{}") is None  # nothing pooled
            assert client.send_now("ftp://nowhere/x", JSON, b"{}") is None
            assert server.num_requests == 0
            assert await read_all(await client.send(server.url + "/x", JSON, b"{}")) == b"0"
            seen.clear()
            pending = client.send_now(server.url + "/x", JSON, b'{"second": 1}')
            assert pending is not None
            await asyncio.wait_for(seen.wait(), HANG_GUARD_S)  # the upstream has it already
            assert server.connections[0][1][1] == b'{"second": 1}'
            response = await pending
            assert response.status == 200 and await read_all(response) == b"1"
            again = client.send_now(server.url + "/x", JSON, b"{}")  # pooled again
            assert again is not None and await read_all(await again) == b"2"
            await client.aclose()
        assert len(server.connections) == 1
    run(main)


def test_send_now_on_a_pooled_connection_the_upstream_closed_is_not_sent_twice():
    async def main():
        async with Server(answer_but_close_at_the_second) as server:
            client = transport()
            assert await read_all(await client.send(server.url + "/x", JSON, b"{}"))
            pending = client.send_now(server.url + "/x", JSON, b"{}")
            assert pending is not None
            with pytest.raises(UpstreamBroken):
                await pending
            await client.aclose()
        assert [len(c) for c in server.connections] == [2]
    run(main)


def test_the_read_timeout_counts_silence_not_the_whole_head():
    """A head that trickles in over more than read_timeout_s, each gap well inside it, is
    read; the timeout is the silence since the last byte (the hang guard bounds the test)."""
    head = ok(b"done")

    async def answer(server, conn, index, head_, writer):
        for i in range(0, len(head), len(head) // 6 + 1):
            writer.write(head[i:i + len(head) // 6 + 1])
            await writer.drain()
            await asyncio.sleep(0.25)  # 6 gaps: 1.5 s in all, each a quarter of the timeout
        return True

    async def main():
        async with Server(answer) as server:
            client = transport(read_timeout_s=1.0)
            response = await client.send(server.url + "/x", JSON, b"{}")
            assert await read_all(response) == b"done"
            await client.aclose()
    run(main)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: xchunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-evil: a\x00b\r\ncontent-length: 2\r\n\r\nok",
])
def test_a_malformed_head_on_a_kept_open_connection_fails_at_once(reply):
    async def answer(server, conn, index, head, writer):
        writer.write(reply)
        await server.until_the_client_closes(conn)
        return False

    async def main():
        async with Server(answer) as server:
            client = transport(read_timeout_s=600.0)  # the hang guard would end a wait first
            with pytest.raises(UpstreamMalformed):
                await client.send(server.url + "/x", JSON, b"{}")
            await server.closed_by_peer[0].wait()  # and the connection is closed
            await client.aclose()
    run(main)
