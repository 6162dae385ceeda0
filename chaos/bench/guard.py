"""``kvguard bench guard``: what the admission middleware adds to a request, side by side.

The same trivial ASGI app (a fixed JSON completion, plus an idle ``/kvguard/state``) is
driven bare and wrapped in :class:`~guard.middleware.AdmissionMiddleware`, in one process and
one run, alternating blocks of requests so drift hits both equally:

* in-process: the ASGI callable is awaited directly with a minimal receive/send — the guard's
  whole per-request cost (header parsing, body read, pricing, snapshot, policy, ticket,
  relay, release) and nothing else;
* ``--http``: the same two apps served by uvicorn on loopback, one client request at a time.

In-process, each block's thread CPU time is also recorded (``cpu_us``: CPU µs per request, the
median over blocks; ``added_cpu_us``: guarded minus bare). Wall time counts every moment another
process held the core; CPU time counts only this thread's work, so on a shared machine it moves
far less from run to run. Both are reported; the targets are on wall time.

Targets: median added latency ≤ 100 µs in-process; guarded rate ≥ 0.9× bare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable

__all__ = ["configure", "run", "measure_in_process", "measure_http", "trivial_app"]

_BODY = json.dumps({"model": "bench", "prompt": "Say hello to the guard.", "max_tokens": 16}).encode()
_ANSWER = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "model": "bench",
    "choices": [{"index": 0, "text": " hello", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7},
}).encode()
_STATE = json.dumps({
    "model": "bench", "backend": "sim", "max_model_len": 4096, "block_size": 16,
    "num_total_blocks": 100000, "num_free_blocks": 100000, "max_num_seqs": 256,
    "max_num_batched_tokens": 8192, "num_preemptions": 0, "step_count": 0, "now_s": 0.0,
    "running": [], "waiting": [], "iterations": [], "timing_model": None, "time_scale": 1.0,
}).encode()
_SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
    "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
    "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
    "server": ("127.0.0.1", 8000),
    "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                (b"content-length", str(len(_BODY)).encode()),
                (b"authorization", b"Bearer sk-bench")],
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=20000, help="in-process requests per app")
    parser.add_argument("--block", type=int, default=500, help="requests per alternating block")
    parser.add_argument("--policy", default="slo", help="admission policy (default: slo)")
    parser.add_argument("--http", action="store_true", help="also measure over loopback HTTP")
    parser.add_argument("--http-requests", type=int, default=1000, help="HTTP requests per app")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each stage of the guarded path in isolation")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--against", metavar="DIR", default=None,
                        help="also measure another kvguard checkout's guard side by side (e.g. a "
                             "`git worktree` of an older commit) and report the ratio")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds per side with --against")


def run(args: argparse.Namespace) -> int:
    if args.iterations < 1 or args.block < 1 or args.http_requests < 1:
        raise ValueError("--iterations, --block and --http-requests must be >= 1")
    results = {"in_process": asyncio.run(measure_in_process(args.iterations, args.block, args.policy))}
    if args.http:
        results["http"] = measure_http(args.http_requests, args.policy)
    breakdown = asyncio.run(measure_breakdown(args.policy)) if args.breakdown else None
    if args.against is not None:
        from chaos.bench.guard_against import measure_against, render_against

        results["against"] = measure_against(args.against, args.iterations, args.block,
                                             args.policy, args.rounds)
    if args.json:
        print(json.dumps({**results, "breakdown_us": breakdown}, indent=2))
        return 0
    print(render(results))
    if "against" in results:
        print(render_against(results["against"]))
    if breakdown:
        print("\nstage (in isolation)            median µs")
        for stage, us in breakdown.items():
            print(f"{stage:<32} {us:>9.1f}")
    return 0


async def trivial_app(scope: dict, receive: Callable, send: Callable) -> None:
    """A fixed completion for POSTs, an idle replica's state for ``/kvguard/state``."""
    if scope["type"] != "http":
        return
    body = _STATE if scope["path"] == "/kvguard/state" else _ANSWER
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _guarded(policy: str):
    from prometheus_client import CollectorRegistry

    from guard.config import GuardConfig
    from guard.middleware import AdmissionMiddleware

    return AdmissionMiddleware(trivial_app, GuardConfig(policy=policy), registry=CollectorRegistry())


async def _drive(app, num: int, samples_ns: list[int], cpu_ns: list[float] | None = None) -> None:
    """``num`` requests to ``app``: each one's wall ns into ``samples_ns``; the block's thread
    CPU ns per request into ``cpu_ns`` (when given)."""
    message = {"type": "http.request", "body": _BODY, "more_body": False}

    async def receive() -> dict:
        return message

    async def send(_: dict) -> None:
        pass

    clock = time.perf_counter_ns
    cpu_start = time.thread_time_ns()
    for _ in range(num):
        start = clock()
        await app(_SCOPE, receive, send)
        samples_ns.append(clock() - start)
        await asyncio.sleep(0)  # let background tasks (the state poller) run, as a server would
    if cpu_ns is not None:
        cpu_ns.append((time.thread_time_ns() - cpu_start) / num)


async def measure_in_process(iterations: int, block: int, policy: str) -> dict:
    guard = _guarded(policy)
    bare_ns: list[int] = []
    guarded_ns: list[int] = []
    cpu_ns: dict[str, list[float]] = {"bare": [], "guarded": []}
    await _drive(trivial_app, min(block, iterations), [])  # warm-up, both paths
    await _drive(guard, min(block, iterations), [])
    for done in range(0, iterations, block):
        n = min(block, iterations - done)
        await _drive(trivial_app, n, bare_ns, cpu_ns["bare"])
        await _drive(guard, n, guarded_ns, cpu_ns["guarded"])
    held = guard.controller.tickets.num_held
    await guard.aclose()
    if held:
        raise RuntimeError(f"bench left {held} tickets held")
    result = _compare(bare_ns, guarded_ns, policy)
    for name in ("bare", "guarded"):
        result[name]["cpu_us"] = statistics.median(cpu_ns[name]) / 1e3
    result["added_cpu_us"] = result["guarded"]["cpu_us"] - result["bare"]["cpu_us"]
    return result


async def measure_breakdown(policy: str, num: int = 3000) -> dict[str, float]:
    """Median µs of each stage of the guarded path, timed alone (after a warm-up)."""
    from guard.request.body import headers_from_scope

    guard = _guarded(policy)
    await _drive(guard, 200, [])
    now_s = guard.controller.clock()
    headers = headers_from_scope(_SCOPE)
    price = lambda: guard.controller.pricer.price_request(  # noqa: E731
        _BODY, "/v1/completions", headers, guard.controller._anonymous, now_s, max_model_len=4096,
        block_size=16, request_id="bench")
    cost = price().cost
    snapshot = guard.controller.load_state.snapshot(now_s)
    stages = {
        "python reference (dict of 8)": lambda: dict(a=1, b=2, c=3, d=4, e=5, f=6, g=7, h=8),
        "headers (pricing)": lambda: headers_from_scope(_SCOPE),
        "price (pricing)": price,
        "snapshot, idle (load_state)": lambda: guard.controller.load_state.snapshot(now_s),
        "decide (policy)": lambda: guard.controller.policy.decide(cost, snapshot),
        "reserve+release (load_state)": lambda: _reserve_release(guard, cost, now_s),
        "ticket issue+release (listeners)": lambda: _issue_release(guard, cost, now_s),
        "decide+reserve+ticket+release": lambda: _cycle(guard, cost, now_s),
    }
    out = {name: _median_us(fn, num) for name, fn in stages.items()}
    await guard.aclose()
    return out


def _cycle(guard, cost, now_s: float) -> None:
    from policies.decision import Admit

    decision = guard.controller.decider.decide(cost, now_s)
    if isinstance(decision, Admit):
        reservation = guard.controller.load_state.reservation(cost.request_id)
        guard.controller.tickets.issue(reservation, now_s).release("completed")


def _reserve_release(guard, cost, now_s: float) -> None:
    guard.controller.load_state.reserve("local", cost.request_id, cost, now_s)
    guard.controller.load_state.release(cost.request_id)


def _issue_release(guard, cost, now_s: float) -> None:
    from guard.replicas.reservations import Reservation

    guard.controller.tickets.issue(Reservation("local", cost, now_s), now_s).release("completed")


def _median_us(fn: Callable[[], object], num: int) -> float:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(num):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples) / 1e3


def _stats_us(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    total_s = sum(ordered) / 1e9
    return {"n": len(ordered), "median_us": statistics.median(ordered) / 1e3,
            "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3,
            "rate_rps": len(ordered) / total_s if total_s > 0 else float("inf")}


def _compare(bare_ns: list[int], guarded_ns: list[int], policy: str) -> dict:
    bare, guarded = _stats_us(bare_ns), _stats_us(guarded_ns)
    return {"policy": policy, "bare": bare, "guarded": guarded,
            "added_median_us": guarded["median_us"] - bare["median_us"],
            "added_p99_us": guarded["p99_us"] - bare["p99_us"],
            "rate_ratio": guarded["rate_rps"] / bare["rate_rps"]}


def measure_http(num_requests: int, policy: str) -> dict:
    """Both apps under uvicorn on loopback (one server thread each), one request at a time
    over a keep-alive connection written in one segment (no Nagle/delayed-ACK stalls)."""
    servers = [_serve(trivial_app), _serve(_guarded(policy))]
    clients = [_RawClient(port) for _, port in servers]
    try:
        samples: list[list[int]] = [[], []]
        for client in clients:  # warm-up
            for _ in range(50):
                client.post()
        for done in range(0, num_requests, 100):
            for index, client in enumerate(clients):
                client.post_many(min(100, num_requests - done), samples[index])
        return _compare(samples[0], samples[1], policy)
    finally:
        for client in clients:
            client.close()
        for server, _ in servers:
            server.should_exit = True


class _RawClient:
    """A minimal HTTP/1.1 keep-alive client: one ``sendall`` per request, TCP_NODELAY."""

    def __init__(self, port: int) -> None:
        import socket

        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
            b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
        self._buffer = b""

    def post(self) -> int:
        self._sock.sendall(self._request)
        while b"\r\n\r\n" not in self._buffer:
            self._buffer += self._recv()
        head, _, rest = self._buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += self._recv()
        self._buffer = rest[length:]
        return status

    def _recv(self) -> bytes:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise RuntimeError("bench server closed the connection")
        return chunk

    def post_many(self, num: int, samples_ns: list[int]) -> None:
        for _ in range(num):
            start = time.perf_counter_ns()
            status = self.post()
            samples_ns.append(time.perf_counter_ns() - start)
            if status != 200:
                raise RuntimeError(f"bench request answered {status}")

    def close(self) -> None:
        self._sock.close()


def _serve(app):
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("bench server did not start")
    return server, port


def render(results: dict) -> str:
    lines = [f"{'mode':<11} {'app':<8} {'n':>7} {'median µs':>10} {'p99 µs':>10} {'req/s':>10}"]
    for mode, r in results.items():
        if mode == "against":
            continue
        for name in ("bare", "guarded"):
            s = r[name]
            lines.append(f"{mode:<11} {name:<8} {s['n']:>7} {s['median_us']:>10.1f} "
                         f"{s['p99_us']:>10.1f} {s['rate_rps']:>10.0f}")
        lines.append(f"{mode:<11} added median {r['added_median_us']:.1f} µs, p99 "
                     f"{r['added_p99_us']:.1f} µs, rate ratio {r['rate_ratio']:.3f} "
                     f"(policy {r['policy']})")
        if "added_cpu_us" in r:
            lines.append(f"{mode:<11} added CPU {r['added_cpu_us']:.1f} µs per request "
                         f"(thread CPU time, median over blocks: bare "
                         f"{r['bare']['cpu_us']:.1f}, guarded {r['guarded']['cpu_us']:.1f})")
    return "\n".join(lines)
