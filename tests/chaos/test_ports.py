"""chaos.ports: ports for children that restart on the same port lie below the ephemeral range."""

import socket

import pytest

from chaos import ports


def bindable(port: int) -> bool:
    """A server can listen on ``port`` and a loopback client reach it there."""
    try:
        server = socket.create_server(("127.0.0.1", port))
    except OSError:
        return False
    with server, socket.create_connection(("127.0.0.1", port), timeout=5.0):
        return True


def test_the_ephemeral_range_is_read_from_the_kernel():
    low, high = ports.ephemeral_range()
    assert 1024 <= low < high <= 65_535
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            assert (low, high) == tuple(int(x) for x in f.read().split())
    except FileNotFoundError:
        pytest.skip("no /proc: the fallback range is used")


def test_ports_are_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST_PORT <= port < low and bindable(port)
        bus = ports.free_port(also_free=10_000)
        assert bus + 10_000 < low and bindable(bus) and bindable(bus + 10_000)


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        picks = iter([port, port, port + 1])
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (port + 2_000, 65_535))
        monkeypatch.setattr(ports, "LOWEST_PORT", port - 1)
        if not bindable(port + 1):
            pytest.skip("the neighbouring port is in use")
        assert ports.free_port() == port + 1


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT + 10, 65_535))
    port = ports.free_port()
    assert bindable(port)
    with pytest.raises(ValueError, match="also_free"):
        ports.free_port(also_free=-1)


def test_seeding_the_global_generator_does_not_repeat_the_ports():
    """Two processes that both seed ``random`` the same way still get their own ports."""
    import random

    state = random.getstate()
    try:
        random.seed(7)
        first = [ports.free_port() for _ in range(5)]
        random.seed(7)
        assert [ports.free_port() for _ in range(5)] != first
    finally:
        random.setstate(state)
