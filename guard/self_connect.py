"""Refuse a TCP connection that the kernel connected to itself.

A client that connects to a port on which nothing listens, and whose kernel picks that same
port as the connection's local port (the port lies in the ephemeral range), is connected to
itself: Linux treats the SYN it receives as a simultaneous open. The "server" is then the
client's own echo (an HTTP client reads its request back as the response, a Redis client its
command as the reply), and while the socket stays open the real server cannot bind its port
again. Both of the guard's own clients (the proxy's upstream transport and the budget store's
Redis client) check every new connection with :func:`connected_to_itself` and drop it with
:func:`drop` (as a refused connect).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

__all__ = ["connected_to_itself", "drop", "reset_on_close", "socket_connected_to_itself"]

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST, no TIME_WAIT


def connected_to_itself(transport: Any) -> bool:
    """Whether an asyncio transport's socket has the same address at both ends."""
    sock = transport.get_extra_info("socket")
    return sock is not None and socket_connected_to_itself(sock)


def socket_connected_to_itself(sock: Any) -> bool:
    """Whether a socket has the same address at both ends."""
    try:
        return sock.getsockname() == sock.getpeername()
    except OSError:  # not connected any more: whatever reads from it next finds that out
        return False


def reset_on_close(sock: Any) -> None:
    """Make closing ``sock`` send a reset (nothing left in TIME_WAIT on its port)."""
    with contextlib.suppress(OSError):  # closed already: nothing is left on the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)


async def drop(transport: Any) -> None:
    """Close a transport's connection with a reset, and return once its socket is closed (the
    transport closes it on the loop's next turn). A socket connected to itself and closed the
    ordinary way ends in TIME_WAIT on its own port, which keeps the real server from binding
    that port for a minute; reset, it leaves nothing behind."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        reset_on_close(sock)
    transport.abort()
    await asyncio.sleep(0)  # the abort's close runs first: it was scheduled before this wakeup
