"""``kvguard bench loadgen``: what the load generator itself costs per request.

``kvguard load``'s runner (:func:`chaos.load.run_load`, the client every load bench uses) sends
``--rate`` req/s for ``--duration`` s to a trivial server on loopback, and the run reports the
generator's own CPU per request (user + system seconds of this process, which contention
inflates far less than wall time), the CPU it waited for, the rate it achieved and its send
lag. A generator that needs C µs of CPU per request cannot offer more than 10⁶ / C req/s on
one core, whatever the server does: read the other benches' rates against this one.

The server (a child process, so its CPU is not counted) is a keep-alive HTTP/1.1 responder on
raw asyncio protocols, far cheaper per request than the generator: ``--answer stream`` sends
``--tokens`` SSE token chunks, a usage chunk and ``[DONE]``; ``--answer shed`` a 503 with the
guard's headers (what a flood of sheds looks like). ``--hold-s`` delays every answer, so about
rate × hold requests, each on its own connection, are pending at once — where a client whose
connection pool scans its connections per request (httpx/httpcore 1.0: it stalled ``kvguard
bench sheds`` for minutes) falls over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

from chaos.child import ChildProcess
from chaos.topology import http_health

__all__ = ["configure", "run", "trivial_server", "serve"]

_SHED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"retry-after: 1\r\nx-kvguard-reason: slo_unattainable\r\ncontent-length: 66\r\n\r\n"
         b'{"error": {"message": "overloaded", "code": "slo_unattainable"}}\r\n')
_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


def _stream_answer(num_tokens: int) -> bytes:
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    events = []
    for i in range(num_tokens):
        reason = "length" if i == num_tokens - 1 else None
        events.append({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": reason}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": num_tokens,
                                            "total_tokens": num_tokens + 1}})
    body = b"".join(chunk(b"data: " + json.dumps(e).encode() + b"\n\n") for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body + chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n")


class _Responder(asyncio.Protocol):
    """Answers each request on a connection in order; bodies are skipped by content-length."""

    def __init__(self, answer: bytes, hold_s: float) -> None:
        self._answer, self._hold_s = answer, hold_s
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip() == b"content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            self._buffer = self._buffer[end + 4 + length:]
            answer = _HEALTH if head.startswith(b"get") else self._answer
            if self._hold_s > 0 and answer is not _HEALTH:
                asyncio.get_running_loop().call_later(self._hold_s, self._write, answer)
            else:
                self._write(answer)

    def _write(self, answer: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(answer)


async def serve(port: int, answer: str, num_tokens: int, hold_s: float) -> None:
    """Serve until killed; prints ``trivial server listening on URL`` once bound."""
    body = _SHED if answer == "shed" else _stream_answer(num_tokens)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Responder(body, hold_s), "127.0.0.1", port, backlog=8192)
    bound = server.sockets[0].getsockname()[1]
    print(f"trivial server listening on http://127.0.0.1:{bound}", flush=True)
    await server.serve_forever()


def trivial_server(answer: str = "stream", num_tokens: int = 8, hold_s: float = 0.0
                   ) -> ChildProcess:
    """The server as a child process (not started)."""
    return ChildProcess(
        "trivial-server",
        lambda port: [sys.executable, "-m", "chaos.bench.loadgen", "--serve", str(port),
                      "--answer", answer, "--tokens", str(num_tokens), "--hold-s", repr(hold_s)],
        http_health, ready_pattern=r"trivial server listening on (\S+)")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=2000.0, help="offered req/s")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals")
    p.add_argument("--answer", choices=("stream", "shed"), default="shed",
                   help="what the server answers: an SSE stream or a 503 shed")
    p.add_argument("--tokens", type=int, default=8, help="token chunks per stream")
    p.add_argument("--hold-s", type=float, default=0.0,
                   help="the server answers after this long (keeps rate × hold pending)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="the client's connection pool size")
    p.add_argument("--client", choices=("aiohttp", "raw"), default="aiohttp",
                   help="the generator's HTTP client (chaos.load.CLIENTS)")


def run(args: argparse.Namespace) -> int:
    if not (args.rate > 0 and args.duration > 0 and args.tokens >= 1 and args.hold_s >= 0
            and args.max_connections >= 1):
        raise ValueError("need --rate, --duration > 0, --tokens >= 1, --hold-s >= 0, "
                         "--max-connections >= 1")
    from chaos.load import LoadConfig, run_load
    from chaos.schedule import LengthDist, ScheduleConfig, build_schedule

    specs = build_schedule(ScheduleConfig(
        rate_per_s=args.rate, duration_s=args.duration, shape="constant",
        prompt_tokens=LengthDist("fixed", 32, 32),
        output_tokens=LengthDist("fixed", args.tokens, args.tokens)))
    server = trivial_server(args.answer, args.tokens, args.hold_s).start()
    try:
        cfg = LoadConfig(url=server.url, duration_s=args.duration, timeout_s=30.0,
                         drain_timeout_s=30.0, max_connections=args.max_connections,
                         client=args.client)
        result = asyncio.run(run_load(specs, cfg))
    finally:
        server.close()
    row = {"client": args.client, **loadgen_row(result)}
    print(json.dumps(row, indent=1))
    for w in result.warnings():
        print(f"WARNING: {w}", file=sys.stderr)
    return 0


def loadgen_row(result) -> dict:
    """The generator's own figures from a :class:`chaos.load.LoadResult`."""
    n = len(result.records)
    lag = result.lag_s()
    return {
        "requests": n, "outcomes": dict(Counter(r.outcome for r in result.records)),
        "scheduled_rps": result.scheduled_rate_per_s, "achieved_rps": result.achieved_rate_per_s,
        "cpu_us_per_request": 1e6 * result.cpu_s / n if n else None,
        "cpu_percent_of_one_core": result.cpu_percent, "cpu_wait_s": result.cpu_wait_s,
        "wall_s": result.wall_s,
        "send_lag_p50_ms": 1000 * lag["p50"] if lag.get("p50") is not None else None,
        "send_lag_p99_ms": 1000 * lag["p99"] if lag.get("p99") is not None else None,
    }


if __name__ == "__main__":  # the server child: python -m chaos.bench.loadgen --serve PORT ...
    _parser = argparse.ArgumentParser(description="the trivial server of kvguard bench loadgen")
    configure(_parser)
    _parser.add_argument("--serve", type=int, required=True, metavar="PORT")
    _args = _parser.parse_args()
    asyncio.run(serve(_args.serve, _args.answer, _args.tokens, _args.hold_s))
