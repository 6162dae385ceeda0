"""Connections that reach themselves, made on purpose.

The kernel connects a socket to itself when it connects to a port nothing listens on and has
picked that same port as the socket's local port (rare, and only in the ephemeral range).
Binding the local port to the target port first makes the same thing happen every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Iterator

__all__ = ["self_connected_socket", "connects_to_itself"]


def self_connected_socket(port: int) -> socket.socket:
    """A TCP socket on 127.0.0.1:``port`` connected to itself (nothing may listen there)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def connects_to_itself(loop: asyncio.AbstractEventLoop, port: int) -> Iterator[None]:
    """While inside: ``loop.create_connection`` to 127.0.0.1:``port`` uses ``port`` as its
    local port too, so the connection reaches itself (as if the kernel had picked it)."""
    original = loop.create_connection

    @functools.wraps(original)
    async def create_connection(factory, host=None, port_=None, **kwargs):
        if host == "127.0.0.1" and port_ == port:
            kwargs["local_addr"] = ("127.0.0.1", port)
        return await original(factory, host, port_, **kwargs)

    loop.create_connection = create_connection  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.create_connection  # the class's method again
