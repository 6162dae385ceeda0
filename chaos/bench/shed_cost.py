"""``kvguard bench shed-cost``: CPU time per shed in ``kvguard proxy``'s ASGI app, in-process.

The proxy's answer to a flood is a 503 per request, so what one shed costs in CPU bounds how
many it can answer per second on one core. This bench awaits the proxy app directly (no
sockets, no server, no other process) for requests the ``slo`` policy must shed — the only
replica's state says its KV cache is full for longer than any deadline — and reports the
process CPU time per shed (``time.process_time``: it counts this process's CPU only, so
other work on the machine inflates it far less than wall time would). ``--profile`` prints
the functions that take the most of it (cProfile, cumulative).

    kvguard bench shed-cost --requests 20000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import time

__all__ = ["configure", "run", "measure"]

_BODY = json.dumps({"model": "llama-7b", "prompt": "Say hello to the guard.",
                    "max_tokens": 16}).encode()
_SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
    "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
    "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
    "server": ("127.0.0.1", 9000),
    "headers": [(b"host", b"127.0.0.1:9000"), (b"content-type", b"application/json"),
                (b"content-length", str(len(_BODY)).encode()),
                (b"authorization", b"Bearer sk-bench")],
}


def _full_state() -> dict:
    """A replica whose every block is held by streams that run for a long time yet."""
    running = [{"request_id": f"e{i}", "num_prompt_tokens": 1000, "num_output_tokens": 10,
                "max_tokens": 100_000, "num_context_tokens": 1010,
                "num_prefill_tokens_remaining": 0, "num_blocks": 64} for i in range(16)]
    return {"model": "llama-7b", "backend": "sim", "max_model_len": 131_072, "block_size": 16,
            "num_total_blocks": 1024, "num_free_blocks": 0, "max_num_seqs": 16,
            "max_num_batched_tokens": 2048, "num_preemptions": 0, "step_count": 0,
            "now_s": 0.0, "running": running, "waiting": [], "iterations": [],
            "timing_model": None, "time_scale": 1.0}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20000, help="sheds to time")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top functions by cumulative CPU (cProfile)")


def _app():
    from guard.config import GuardConfig
    from guard.proxy.app import ProxyApp

    config = GuardConfig.from_dict({
        "policy": "slo", "refresh_interval_s": 3600.0, "max_staleness_s": 3600.0,
        "state_timeout_s": 0.05, "unhealthy_after_errors": 1000,
        # port 9 (discard): nothing listens, the one state poll at start fails fast
        "replicas": [{"url": "http://127.0.0.1:9", "state_source": "kvguard"}]})
    return ProxyApp(config)


async def measure(num: int, profile: bool = False) -> dict:
    """CPU µs per shed over ``num`` sheds (after 500 warm-up ones); the (status, reason)
    answers seen."""
    app = _app()
    await app.start()
    app.load_state.update_from_kvguard_state("r0", _full_state(), app.clock())
    statuses: dict[tuple[int, str], int] = {}

    async def receive() -> dict:
        return {"type": "http.request", "body": _BODY, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            reason = dict(message["headers"]).get(b"x-kvguard-reason", b"").decode()
            key = (message["status"], reason)
            statuses[key] = statuses.get(key, 0) + 1

    for _ in range(500):
        await app(_SCOPE, receive, send)
    statuses.clear()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(num):
        await app(_SCOPE, receive, send)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    report = None
    if profiler is not None:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        report = out.getvalue()
    await app.aclose()
    return {"requests": num, "statuses": statuses, "cpu_us_per_shed": 1e6 * cpu_s / num,
            "wall_us_per_shed": 1e6 * wall_s / num, "profile": report}


def run(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise ValueError("--requests: must be >= 1")
    result = asyncio.run(measure(args.requests, args.profile))
    answers = ", ".join(f"{n} × {status} {reason}"
                        for (status, reason), n in result["statuses"].items())
    print(f"{result['requests']} requests ({answers}): "
          f"{result['cpu_us_per_shed']:.1f} µs CPU per shed "
          f"({result['wall_us_per_shed']:.1f} µs wall)")
    if result["profile"]:
        print(result["profile"])
    return 0
