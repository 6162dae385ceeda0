"""The state streams' sockets read in rounds (:mod:`guard.replicas.stream_reads`), over real
loopback connections: bytes wait for the round, the bytes of several streams that came between
two rounds are read in one, every way a connection ends reaches its protocol once, and a loop
with no stream open holds no timer and no selector."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from guard.replicas import stream_reads as reads_module
from guard.replicas.state_stream import StreamStateSource
from guard.replicas.stream_reads import (
    READ_ROUND_FRACTION,
    READ_ROUND_S,
    RoundTransport,
    StreamReads,
    read_round_s,
    stream_reads,
)


class Recorder(asyncio.Protocol):
    """What a protocol was told, in order."""

    def __init__(self, request: bytes = b"") -> None:
        self.request = request
        self.calls: list[tuple] = []
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.calls.append(("made",))
        if self.request:
            transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.calls.append(("data", data))

    def eof_received(self) -> None:
        self.calls.append(("eof",))

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append(("lost", exc))
        self.lost.set_result(exc)

    @property
    def data(self) -> bytes:
        return b"".join(c[1] for c in self.calls if c[0] == "data")


async def _server():
    """A loopback server that keeps each connection's writer and what it was sent."""
    writers: list[asyncio.StreamWriter] = []
    received: list[bytes] = []

    async def handle(reader, writer):  # noqa: ANN001
        writers.append(writer)
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                received.append(data)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], writers, received


async def _until(condition, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline_s, "not within the time"
        await asyncio.sleep(0.005)


def run(body):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(body(), 30))


def test_bytes_wait_for_the_round_and_several_streams_are_read_in_one():
    async def main():
        server, port, writers, received = await _server()
        reads = StreamReads(asyncio.get_running_loop(), period_s=3600.0)
        try:
            opened = [await reads.create_connection(lambda: Recorder(b"GET / HTTP/1.1\r\n\r\n"),
                                                    "127.0.0.1", port, period_s=3600.0)
                      for _ in range(3)]
            await _until(lambda: len(writers) == 3 and len(received) == 3)
            assert received == [b"GET / HTTP/1.1\r\n\r\n"] * 3  # the request went at once
            for k, writer in enumerate(writers):
                writer.write(b"event %d" % k)
                await writer.drain()
            await asyncio.sleep(0.1)  # the bytes are in: the loop's own poll would have read
            protocols = [protocol for _, protocol in opened]
            assert all(p.calls == [("made",)] for p in protocols)
            reads._round()  # the round the timer would run
            assert sorted(p.data for p in protocols) == [b"event 0", b"event 1", b"event 2"]
            assert reads.num_rounds == 1 and reads.num_reads == 3
            reads._round()  # nothing new: nothing read
            assert reads.num_reads == 3
        finally:
            for transport, _ in opened:
                transport.abort()
            server.close()

    run(main)


def test_the_timer_reads_each_round_at_the_shortest_period_asked():
    async def main():
        server, port, writers, _ = await _server()
        reads = StreamReads(asyncio.get_running_loop())
        slow, _ = await reads.create_connection(Recorder, "127.0.0.1", port, period_s=3600.0)
        assert reads.period_s == READ_ROUND_S  # never longer than the reads' own
        fast, fast_protocol = await reads.create_connection(Recorder, "127.0.0.1", port,
                                                            period_s=0.002)
        assert reads.period_s == 0.002
        await _until(lambda: len(writers) == 2)
        writers[1].write(b"soon")
        await _until(lambda: fast_protocol.data == b"soon")  # the timer's round read it
        assert reads.num_rounds >= 1
        fast.abort()
        await fast_protocol.lost
        assert reads.period_s == READ_ROUND_S and len(reads) == 1
        slow.abort()
        assert len(reads) == 0 and reads._timer is None and reads._selector is None
        server.close()

    run(main)


def test_eof_a_reset_and_an_abort_each_reach_the_protocol_once():
    async def main():
        server, port, writers, _ = await _server()
        reads = StreamReads(asyncio.get_running_loop())
        ended, ended_p = await reads.create_connection(Recorder, "127.0.0.1", port,
                                                       period_s=0.002)
        reset, reset_p = await reads.create_connection(Recorder, "127.0.0.1", port,
                                                       period_s=0.002)
        aborted, aborted_p = await reads.create_connection(Recorder, "127.0.0.1", port,
                                                           period_s=0.002)
        await _until(lambda: len(writers) == 3)
        writers[0].write(b"last words")
        writers[0].close()  # the bytes, then EOF
        sock = writers[1].get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writers[1].transport.abort()  # a reset
        assert await asyncio.wait_for(ended_p.lost, 5) is None
        assert ended_p.calls == [("made",), ("data", b"last words"), ("eof",), ("lost", None)]
        why = await asyncio.wait_for(reset_p.lost, 5)
        assert reset_p.calls[-1] == ("lost", why)
        assert why is None or isinstance(why, ConnectionResetError)  # an EOF first, or reset
        aborted.abort()
        aborted.abort()  # twice: told once
        assert await aborted_p.lost is None
        assert [c for c in aborted_p.calls if c[0] == "lost"] == [("lost", None)]
        assert aborted.is_closing() and aborted.get_extra_info("socket").fileno() == -1
        assert len(reads) == 0 and reads._selector is None
        server.close()

    run(main)


def test_nothing_listening_is_refused_and_a_connection_to_itself_too(monkeypatch):
    async def main():
        reads = StreamReads(asyncio.get_running_loop())
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]  # bound, not listening: connects are refused
            with pytest.raises(ConnectionRefusedError):
                await reads.create_connection(Recorder, "127.0.0.1", port)
        server, port, _, _ = await _server()
        closed = []
        real_close = socket.socket.close
        monkeypatch.setattr(reads_module, "socket_connected_to_itself", lambda sock: True)
        monkeypatch.setattr(socket.socket, "close",
                            lambda self: (closed.append(self), real_close(self))[1])
        with pytest.raises(ConnectionRefusedError, match="reached itself"):
            await reads.create_connection(Recorder, "127.0.0.1", port)
        assert closed and len(reads) == 0  # closed, never read
        server.close()

    run(main)


def test_a_request_that_does_not_go_at_once_loses_the_connection():
    class HalfSending:
        def __init__(self) -> None:
            self.inner = socket.socket()
            self.inner.setblocking(False)

        def send(self, data: bytes) -> int:
            return len(data) // 2

        def fileno(self) -> int:
            return self.inner.fileno()

        def close(self) -> None:
            self.inner.close()

    async def main():
        reads = StreamReads(asyncio.get_running_loop())
        protocol = Recorder()
        sock = HalfSending()
        transport = RoundTransport(reads, sock, protocol, READ_ROUND_S)  # type: ignore[arg-type]
        reads._add(transport)
        transport.write(b"GET / HTTP/1.1\r\n\r\n")
        why = await protocol.lost
        assert isinstance(why, ConnectionError) and "did not fit" in str(why)
        assert len(reads) == 0

    run(main)


def test_a_protocol_that_fails_ends_its_own_connection_only():
    class Failing(Recorder):
        def data_received(self, data: bytes) -> None:
            raise RuntimeError("a bug")

    async def main():
        loop = asyncio.get_running_loop()
        reported = []
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
        server, port, writers, _ = await _server()
        reads = StreamReads(loop)
        _, failing = await reads.create_connection(Failing, "127.0.0.1", port, period_s=0.002)
        healthy_t, healthy = await reads.create_connection(Recorder, "127.0.0.1", port,
                                                           period_s=0.002)
        await _until(lambda: len(writers) == 2)
        for writer in writers:
            writer.write(b"bytes")
        assert isinstance(await asyncio.wait_for(failing.lost, 5), RuntimeError)
        await _until(lambda: healthy.data == b"bytes")
        assert [str(e) for e in reported] == ["a bug"] and not healthy_t.is_closing()
        healthy_t.abort()
        server.close()

    run(main)


def test_the_round_a_stream_asks_for():
    assert read_round_s(0.1) == READ_ROUND_S
    assert read_round_s(1.0) == READ_ROUND_S
    assert read_round_s(0.02) == pytest.approx(0.02 * READ_ROUND_FRACTION)


def test_a_state_stream_is_read_in_its_loops_rounds():
    """A streamed replica's socket is in the loop's rounds while its stream is open, and out
    of them (no timer, no selector) once the source is closed."""
    from chaos.state_replica import StateReplica
    from engine.compact_state import compact_state

    doc = compact_state(StateReplica(lambda *a: 0.01, num_total_blocks=100).state())

    async def main():
        import json

        async def handle(reader, writer):  # noqa: ANN001
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
            for seq in range(1000):
                event = {"seq": 0, "full": doc} if seq == 0 else {"seq": seq, "delta": {}}
                writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(0.01)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        source = StreamStateSource(f"http://127.0.0.1:{port}", interval_ms=10)
        try:
            assert await source.opened(5.0) is None
            reads = stream_reads()
            assert len(reads) == 1 and reads.period_s == read_round_s(0.01)
            rounds = reads.num_rounds
            await _until(lambda: source.num_events >= 10)
            assert reads.num_rounds > rounds  # its events came by the rounds
        finally:
            await source.aclose()
            server.close()
        assert len(reads) == 0 and reads._timer is None

    run(main)
