"""``python -m chaos.bench.hops``: how many calls one proxied request makes between kvguard's
modules, counted with ``sys.setprofile`` on the proxy's event-loop thread.

The proxy (``kvguard proxy``'s app on kvguard's own HTTP server with the ``h1`` upstream client,
the defaults) runs in-process on its own thread and loop, in front of a minimal streaming
upstream on another thread (three SSE chunks and ``[DONE]``, chunked); its replica's
``state_source`` is ``none``, so no state poll runs while a request is measured. After
``--warmup`` requests, each of ``--requests`` streamed requests is sent from the main thread
over one kept-alive loopback connection and read to its end; the profiler is on in the proxy's
thread from just before the request is sent until its ticket is released. Counted, per request,
over the ``call`` events (C calls are not counted):

* ``calls``: Python functions of the product packages (``guard/``, ``serving/``, ``policies/``)
  entered, coroutine resumptions included;
* ``hops``: those whose caller is a function of the product packages in another file (one module
  calling into another);
* ``admission entries``: those whose callee is in ``guard/controller.py`` or
  ``guard/admission/`` and whose caller is not (a re-entry into the admission and ticket code).

It imports ``guard`` from ``PYTHONPATH``, so the same script counts any checkout:
``PYTHONPATH=<checkout> python chaos/bench/hops.py``. Prints one JSON line with the median of each
count and the ``--top`` busiest module-to-module edges of the median request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

__all__ = ["main"]

BODY = (b'{"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": true}')
_CHUNK = b'data: {"choices": [{"text": "x", "index": 0, "finish_reason": null}]}\n\n'
_DONE = b'data: {"choices": [{"text": "", "index": 0, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'


def _chunked(data: bytes) -> bytes:
    return format(len(data), "x").encode() + b"\r\n" + data + b"\r\n"


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every POST with a short stream; keeps the connection open."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for _ in range(3):
                writer.write(_chunked(_CHUNK))
                await writer.drain()
            writer.write(_chunked(_DONE) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


class _Loop:
    """An event loop on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def run(self, fn, *args) -> None:
        """``fn(*args)`` on the loop's thread, waited for."""
        done = threading.Event()

        def go() -> None:
            fn(*args)
            done.set()
        self.loop.call_soon_threadsafe(go)
        done.wait(10)


class _Counter:
    """The profile function: counts product calls, hops and admission entries."""

    def __init__(self, roots: list[str]) -> None:
        self.roots = tuple(roots)
        self.admission = (roots[0] + "controller.py", roots[0] + "admission" + os.sep)
        self.calls = self.hops = self.entries = 0
        self.edges: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(self.roots):
            return
        self.calls += 1
        back = frame.f_back
        caller = back.f_code.co_filename if back is not None else ""
        if not caller.startswith(self.admission) and callee.startswith(self.admission):
            self.entries += 1
        if caller != callee and caller.startswith(self.roots):
            self.hops += 1
            self.edges[(_short(caller), _short(callee))] += 1


def _short(path: str) -> str:
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if part in ("guard", "serving", "policies"):
            return "/".join(parts[i:])
    return path


def _request(sock: socket.socket, port: int) -> None:
    """One streamed POST, read to the end of its chunked body."""
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                 % (port, len(BODY)) + BODY)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the proxy closed the connection")
        data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(data[:200].decode("latin-1"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):
        del sys.path[0]  # run as a file: this folder's guard.py must not hide the package

    import guard
    from guard.config import GuardConfig
    from guard.proxy.app import ProxyApp
    from serving import ServerLimits
    from serving.h1server import H1Server
    from serving.limited_protocol import ConnectionTable

    root = str(Path(guard.__file__).resolve().parent.parent) + os.sep
    roots = [root + "guard" + os.sep, root + "serving" + os.sep, root + "policies" + os.sep]

    upstream = _Loop()
    up_server = upstream.call(asyncio.start_server(_upstream, "127.0.0.1", 0))
    up_port = up_server.sockets[0].getsockname()[1]
    config = GuardConfig.from_dict({"replicas": [{"replica_id": "r0", "state_source": "none",
                                                  "url": f"http://127.0.0.1:{up_port}"}]})
    app = ProxyApp(config)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    proxy = _Loop()
    server = H1Server(app, ConnectionTable(ServerLimits()))
    if not proxy.call(server.start([listener])):
        raise SystemExit("the proxy did not start")
    sock = socket.create_connection(("127.0.0.1", port))
    for _ in range(args.warmup):
        _request(sock, port)
    counters = []
    for _ in range(args.requests):
        while app.num_in_flight:
            time.sleep(0.001)
        counter = _Counter(roots)
        proxy.run(sys.setprofile, counter)
        _request(sock, port)
        deadline_s = time.monotonic() + 5.0
        while app.num_in_flight and time.monotonic() < deadline_s:
            time.sleep(0.0005)
        proxy.run(sys.setprofile, None)
        counters.append(counter)
    sock.close()
    proxy.call(server.stop())
    middle = sorted(counters, key=lambda c: c.hops)[len(counters) // 2]
    print(json.dumps({
        "checkout": root.rstrip(os.sep),
        "requests": args.requests,
        "calls": statistics.median(c.calls for c in counters),
        "hops": statistics.median(c.hops for c in counters),
        "admission_entries": statistics.median(c.entries for c in counters),
        "top_edges": [[f"{a} -> {b}", n] for (a, b), n in middle.edges.most_common(args.top)],
    }))


if __name__ == "__main__":
    main()
