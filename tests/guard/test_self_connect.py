"""guard.self_connect on real sockets: one connected to itself, an ordinary one, a closed one."""

from __future__ import annotations

import socket

from chaos.ports import free_port
from guard.self_connect import connected_to_itself
from tests.support.self_connect import self_connected_socket


class SocketOnly:
    """What the check reads from an asyncio transport: its socket."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def test_a_socket_connected_to_itself_is_recognised():
    with self_connected_socket(free_port()) as sock:
        assert sock.getsockname() == sock.getpeername()  # the kernel did connect it to itself
        assert connected_to_itself(SocketOnly(sock))


def test_an_ordinary_connection_a_closed_socket_and_no_socket_are_not():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname()) as client:
            assert not connected_to_itself(SocketOnly(client))
    unconnected = socket.socket()
    unconnected.close()
    assert not connected_to_itself(SocketOnly(unconnected))
    assert not connected_to_itself(SocketOnly(None))
