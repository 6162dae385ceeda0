"""``kvguard bench serving``: what the connection limits cost, side by side.

One trivial ASGI app is served three times on loopback in this process: by uvicorn with its own
h11 protocol (``plain``), by uvicorn with ``serving.limited_protocol`` (``limited``: header/body
deadlines, connection caps), and by kvguard's own HTTP/1.1 server (``kvguard``,
``serving.h1server``, the same limits), each on its own event loop in a thread.
A raw-socket client alternates blocks of requests between the two servers so drift hits both
equally, in two modes: ``keep-alive`` (one connection, many requests: the per-request phase
timers) and ``new-connection`` (a connection per request: accept, counting, close). It prints the
median and p99 latency and the request rate of each, and each one's rate over plain's.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

__all__ = ["configure", "run"]

_REQUEST = b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n"
_REQUEST_CLOSE = b"GET / HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n"


async def _app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests per server and mode (default 4000)")
    parser.add_argument("--block", type=int, default=200, help="requests per alternating block")


def _serve_h1():
    import asyncio

    from serving.h1server import H1Server
    from serving.limited_protocol import ConnectionTable
    from serving.server_limits import ServerLimits

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = H1Server(_app, ConnectionTable(ServerLimits()), lifespan=False)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    if not asyncio.run_coroutine_threadsafe(server.start([sock]), loop).result(20.0):
        raise RuntimeError("bench server did not start")
    return server, sock.getsockname()[1]


def _serve(limited: bool):
    import uvicorn

    from serving.limited_protocol import ConnectionTable, uvicorn_config
    from serving.server_limits import ServerLimits

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    kwargs = {"log_level": "warning", "access_log": False, "lifespan": "off"}
    config = (uvicorn_config(_app, ConnectionTable(ServerLimits()), **kwargs) if limited
              else uvicorn.Config(_app, http="h11", **kwargs))
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline_s = time.monotonic() + 20.0
    while not server.started and time.monotonic() < deadline_s:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("bench server did not start")
    return server, sock.getsockname()[1]


def _read_response(sock: socket.socket) -> None:
    data = b""
    while not data.endswith(b"ok"):  # the fixed 2-byte body ends every response
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("bench server closed the connection")
        data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"bench request answered {data[:40]!r}")


def _keep_alive_block(sock: socket.socket, num: int, samples_ns: list[int]) -> None:
    for _ in range(num):
        start = time.perf_counter_ns()
        sock.sendall(_REQUEST)
        _read_response(sock)
        samples_ns.append(time.perf_counter_ns() - start)


def _new_connection_block(port: int, num: int, samples_ns: list[int]) -> None:
    for _ in range(num):
        start = time.perf_counter_ns()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(_REQUEST_CLOSE)
            _read_response(sock)
        samples_ns.append(time.perf_counter_ns() - start)


def _stats(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    return {"n": len(ordered), "median_us": statistics.median(ordered) / 1000,
            "p99_us": ordered[int(0.99 * (len(ordered) - 1))] / 1000,
            "rate_rps": len(ordered) / (sum(ordered) / 1e9)}


def _measure(ports: dict[str, int], mode: str, num: int, block: int) -> dict[str, dict]:
    samples: dict[str, list[int]] = {name: [] for name in ports}
    conns = {name: socket.create_connection(("127.0.0.1", port)) for name, port in ports.items()}
    try:
        for done in range(0, num, block):
            for name, port in ports.items():
                count = min(block, num - done)
                if mode == "keep-alive":
                    _keep_alive_block(conns[name], count, samples[name])
                else:
                    _new_connection_block(port, count, samples[name])
    finally:
        for sock in conns.values():
            sock.close()
    return {name: _stats(s) for name, s in samples.items()}


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.block < 1:
        raise ValueError("--requests and --block must be >= 1")
    servers = {name: _serve(name == "limited") for name in ("plain", "limited")}
    servers["kvguard"] = _serve_h1()
    ports = {name: port for name, (_, port) in servers.items()}
    try:
        print(f"{'mode':<15} {'protocol':<8} {'n':>6} {'median µs':>10} {'p99 µs':>9} "
              f"{'req/s':>8}")
        for mode in ("keep-alive", "new-connection"):
            results = _measure(ports, mode, args.requests, args.block)
            for name, r in results.items():
                print(f"{mode:<15} {name:<8} {r['n']:>6} {r['median_us']:>10.1f} "
                      f"{r['p99_us']:>9.1f} {r['rate_rps']:>8.0f}")
            for name in ("limited", "kvguard"):
                ratio = results[name]["rate_rps"] / results["plain"]["rate_rps"]
                print(f"{mode:<15} {name} / plain request rate: {ratio:.3f}")
    finally:
        for server, _ in servers.values():
            server.should_exit = True  # uvicorn's; the kvguard server's thread is a daemon
    return 0
