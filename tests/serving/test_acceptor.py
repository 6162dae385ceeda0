"""``serving.acceptor.Acceptor`` over real loopback sockets, on asyncio's loop and on uvloop:
a burst of waiting connections is taken within a few loop iterations (libuv alone takes one per
iteration), each with TCP_NODELAY; out of file descriptors it pauses and resumes; close() stops
it."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from serving.acceptor import Acceptor

LOOPS = ["asyncio", "uvloop"]


def _run(kind: str, main):
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


class _Counted(asyncio.Protocol):
    def __init__(self, made: list) -> None:
        self.made = made

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        self.made.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    return sock


@pytest.mark.parametrize("kind", LOOPS)
def test_every_waiting_connection_is_accepted_in_a_few_loop_iterations(kind):
    """100 connections already in the accept queue: all started within 20 loop iterations
    (libuv's own listener would have taken one per iteration), each with TCP_NODELAY."""
    listener = _listener()
    clients = [socket.create_connection(listener.getsockname()) for _ in range(100)]

    async def main():
        made: list[int] = []
        acceptor = Acceptor(asyncio.get_running_loop(), listener, lambda: _Counted(made))
        acceptor.start()
        for _ in range(20):
            await asyncio.sleep(0)
            if len(made) == 100:
                break
        acceptor.close()
        return acceptor.num_accepted, made

    try:
        num_accepted, made = _run(kind, main)
    finally:
        for c in clients:
            c.close()
    assert num_accepted == 100 and len(made) == 100
    assert all(made)  # TCP_NODELAY on every accepted connection


class _NoFds:
    """A listening socket whose accept() fails with EMFILE until ``fail`` is cleared."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.fail = True
        self.calls = 0

    def accept(self):
        self.calls += 1
        if self.fail:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.real.accept()

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("kind", LOOPS)
def test_out_of_file_descriptors_pauses_accepting_then_resumes(kind):
    """EMFILE: one failed accept, then no more (the listener stays readable, so a loop that
    kept reading it would spin) until RETRY_AFTER_S has passed; then the waiting connection
    is accepted."""
    listener = _NoFds(_listener())
    client = socket.create_connection(listener.getsockname())

    async def main():
        made: list[int] = []
        acceptor = Acceptor(asyncio.get_running_loop(), listener, lambda: _Counted(made))
        acceptor.start()
        for _ in range(50):  # 50 loop iterations, far less than the pause
            await asyncio.sleep(0)
        paused_calls = listener.calls
        listener.fail = False
        for _ in range(300):
            await asyncio.sleep(0.02)
            if made:
                break
        acceptor.close()
        return paused_calls, made

    try:
        paused_calls, made = _run(kind, main)
    finally:
        client.close()
    assert paused_calls == 1  # not a busy loop of failing accepts while paused
    assert made == [1]  # accepted once descriptors were back


@pytest.mark.parametrize("kind", LOOPS)
def test_close_stops_accepting_and_closes_the_listener(kind):
    listener = _listener()
    address = listener.getsockname()

    async def main():
        acceptor = Acceptor(asyncio.get_running_loop(), listener, asyncio.Protocol)
        acceptor.start()
        acceptor.close()
        acceptor.close()  # twice is fine
        await asyncio.sleep(0)

    _run(kind, main)
    assert listener.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5)


def test_bad_backlog_is_refused():
    loop = asyncio.new_event_loop()
    try:
        with socket.socket() as sock, pytest.raises(ValueError, match="backlog"):
            Acceptor(loop, sock, asyncio.Protocol, backlog=0)
    finally:
        loop.close()
