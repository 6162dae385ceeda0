"""Loopback ports for children that are killed and started again on the same port.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, the range it also
takes the local port of every outgoing connection from. While a child is down (a chaos fault,
a Redis restart in a test), any connection made by any process on the machine may get that
port as its own local port, and while that connection is open the child cannot bind its port
again ("Address already in use"). A client that keeps reconnecting to the dead port can even
get it for itself: Linux then connects the socket to itself (TCP simultaneous open), and the
"server" it talks to is its own echo.

:func:`free_port` therefore picks a free port *below* the ephemeral range, which the kernel
never gives to an outgoing connection.
"""

from __future__ import annotations

import random
import socket
import sys

__all__ = ["ephemeral_range", "free_port", "LOWEST_PORT"]

LOWEST_PORT = 10_000  # below this: well-known and registered services people run locally
_FALLBACK_RANGE = (32_768, 60_999)  # Linux's default (the IANA range 49152-65535 is above it)
# its own generator, seeded from the OS: code that seeds the global one (a seeded load test, a
# test) would otherwise give two processes the same sequence of ports
_rng = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux: read from /proc)."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                low, high = (int(x) for x in f.read().split())
            return low, high
        except (OSError, ValueError):
            pass
    return _FALLBACK_RANGE


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, also_free: int = 0) -> int:
    """A loopback port free now and outside the ephemeral range (so that it stays free while
    its server is down). ``also_free``: an offset whose port must be free and outside the range
    too (a Redis Cluster node's bus port is ``port + 10000``).

    Where the ephemeral range leaves no room below it, falls back to a port the kernel picks
    (free now, but not protected while its server is down)."""
    if also_free < 0:
        raise ValueError(f"also_free must be >= 0, got {also_free}")
    low, _ = ephemeral_range()
    top = low - 1 - also_free  # the highest port whose offset port is still below the range
    if top - LOWEST_PORT >= 1_000:
        for _ in range(200):
            port = _rng.randint(LOWEST_PORT, top)
            if _free(port) and (not also_free or _free(port + also_free)):
                return port
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if not also_free or (port + also_free <= 65_535 and _free(port + also_free)):
            return port
    raise RuntimeError("no free loopback port found")
