"""``chaos.raw_client``: the load generator's client on raw asyncio protocols, against a
hand-written HTTP/1.1 server on loopback that frames its answers byte by byte as a test asks.

What it must do like the aiohttp client (``tests/chaos/test_load.py`` runs the shared cases on
both): measure from send to the response's last byte, read chunked SSE streams split anywhere,
keep connections alive and honour ``connection: close``, stay within ``max_connections``,
and turn a malformed or cut response into a record, never an exception."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from chaos.client import request_body
from chaos.raw_client import RawCompletionClient, RawConnectionPool
from chaos.records import RequestSpec

SHED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nx-kvguard-reason: slo_unattainable\r\ncontent-length: 17\r\n\r\n"
        b'{"error": "full"}')


def _stream(num_tokens: int) -> bytes:
    events = [b'data: {"choices": [{"text": "t", "finish_reason": null}]}\n\n'] * num_tokens
    events.append(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % num_tokens)
    events.append(b"data: [DONE]\n\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")


class Server:
    """Answers each request on a connection with the next of ``answers`` (bytes, written in
    pieces of ``piece`` bytes; ``None``: close without answering). ``on_last_piece`` runs just
    before the last piece of an answer goes out."""

    def __init__(self, answers: list[bytes | None], piece: int = 0, on_last_piece=None) -> None:
        self.answers = answers
        self.piece = piece
        self.on_last_piece = on_last_piece
        self.num_connections = 0
        self.max_open = 0
        self._open = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self._open += 1
        self.max_open = max(self.max_open, self._open)
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                answer = self.answers.pop(0)
                if answer is None:
                    break
                await self._write(writer, answer)
                if b"connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, answer: bytes) -> None:
        size = self.piece or len(answer)
        pieces = [answer[i:i + size] for i in range(0, len(answer), size)]
        for i, piece in enumerate(pieces):
            if i == len(pieces) - 1 and self.on_last_piece is not None:
                self.on_last_piece()
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)  # let each piece go out as its own segment


def _spec(index: int = 0) -> RequestSpec:
    return RequestSpec(index=index, scheduled_s=0.0, request_class="interactive",
                       tenant="chaos-tenant-0", num_prompt_tokens=3, max_tokens=4)


async def _send_all(server: Server, num: int, *, concurrent: bool = False,
                    max_connections: int = 16, clock=None):
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    pool = RawConnectionPool("127.0.0.1", port, max_connections)
    kwargs = {"clock": clock} if clock is not None else {}
    client = RawCompletionClient(pool, f"http://127.0.0.1:{port}", model=None, timeout_s=10.0,
                                 **kwargs)
    body = request_body(None, "[1, 2, 3]", 4)
    try:
        if concurrent:
            records = await asyncio.gather(*(client.send(_spec(i), body, 0.0)
                                             for i in range(num)))
        else:
            records = [await client.send(_spec(i), body, 0.0) for i in range(num)]
    finally:
        pool.close()
        listener.close()
        await listener.wait_closed()
    return records, pool


def test_the_end_is_stamped_after_the_last_body_byte():
    now = [0.0]
    server = Server([SHED], piece=20, on_last_piece=lambda: now.__setitem__(0, 10.0))
    (record,), _ = asyncio.run(_send_all(server, 1, clock=lambda: now[0]))
    assert record.status == 503 and record.reason == "slo_unattainable"
    assert record.e2e_s == 10.0  # started at 0, ended once the last piece had arrived


def test_a_stream_split_byte_by_byte_is_read_token_by_token():
    server = Server([_stream(4)], piece=1)
    (record,), _ = asyncio.run(_send_all(server, 1))
    assert record.outcome == "completed" and record.saw_done and record.error is None
    assert record.num_tokens_received == 4 and len(record.itl_s) == 3
    assert record.usage == {"completion_tokens": 4}


def test_connections_are_kept_alive_unless_the_server_closes():
    kept = Server([SHED, _stream(2), SHED])
    records, pool = asyncio.run(_send_all(kept, 3))
    assert [r.status for r in records] == [503, 200, 503]
    assert kept.num_connections == pool.num_opened == 1

    closing = SHED.replace(b"retry-after: 1\r\n", b"connection: close\r\n")
    closed = Server([closing] * 3)
    records, pool = asyncio.run(_send_all(closed, 3))
    assert [r.status for r in records] == [503] * 3
    assert closed.num_connections == pool.num_opened == 3


def test_a_connection_idle_for_max_idle_s_is_closed_not_reused():
    # a server closes idle keep-alive connections (kvguard's and uvicorn's: after 5 s); a
    # request written as it does is lost with the connection, so the pool retires them first
    now = [0.0]

    async def main():
        server = Server([SHED] * 4)
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        pool = RawConnectionPool("127.0.0.1", port, 4, max_idle_s=4.0, clock=lambda: now[0])
        client = RawCompletionClient(pool, f"http://127.0.0.1:{port}", model=None,
                                     timeout_s=10.0)
        body = request_body(None, "[1, 2, 3]", 4)
        statuses = []
        try:
            for idle_s in (0.0, 3.9, 4.0):  # idle before each request after the first
                now[0] += idle_s
                statuses.append((await client.send(_spec(), body, 0.0)).status)
        finally:
            pool.close()
            listener.close()
            await listener.wait_closed()
        return statuses, pool, server

    statuses, pool, server = asyncio.run(main())
    assert statuses == [503, 503, 503]
    # the first connection served the request 3.9 s after the one before it, not 4.0 s after
    assert pool.num_opened == server.num_connections == 2 and pool.num_retired == 1
    with pytest.raises(ValueError, match="max_idle_s"):
        RawConnectionPool("127.0.0.1", 1, 1, max_idle_s=0)


def test_requests_beyond_max_connections_wait_for_one():
    server = Server([SHED] * 6)
    records, pool = asyncio.run(_send_all(server, 6, concurrent=True, max_connections=2))
    assert [r.status for r in records] == [503] * 6
    assert server.max_open <= 2 and pool.num_opened <= 2


CUT = "ResponseError: connection closed before the response ended"


@pytest.mark.parametrize("answer, outcome, error", [
    (b"garbage\r\n\r\n", "failed", "ResponseError: bad status line"),
    (None, "failed", CUT),
    (SHED[:-5], "rejected", CUT),  # a 503 whose body was cut: still the server's no
    (_stream(3)[:-40], "failed", CUT),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "failed",
     "ResponseError: invalid chunk"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\ndata: {x\n", "failed", "bad stream chunk"),
])
def test_a_malformed_or_cut_response_is_a_record_not_an_exception(answer, outcome, error):
    server = Server([answer])  # then the server closes the connection
    (record,), _ = asyncio.run(_send_all(server, 1))
    assert record.outcome == outcome and record.error.startswith(error), record.error


def test_a_conversation_turn_sends_its_session_header():
    heads = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head.decode("latin-1").lower())
                length = int(heads[-1].split("content-length: ")[1].split("\r\n")[0])
                await reader.readexactly(length)
                writer.write(_stream(2))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main():
        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        pool = RawConnectionPool("127.0.0.1", port, 4)
        client = RawCompletionClient(pool, f"http://127.0.0.1:{port}", model=None, timeout_s=10.0)
        turn = dataclasses.replace(_spec(), session_id="conversation-7")
        try:
            await client.send(turn, request_body(None, "[1, 2, 3]", 4), 0.0)
            await client.send(_spec(1), request_body(None, "[1, 2, 3]", 4), 0.0)
        finally:
            pool.close()
            listener.close()
            await listener.wait_closed()

    asyncio.run(main())
    assert "x-session-id: conversation-7\r\n" in heads[0]
    assert "x-session-id" not in heads[1]
