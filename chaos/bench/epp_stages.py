"""``python -m chaos.bench.epp_stages``: where a request's time goes through Envoy + kvguard epp.

One sim replica, Envoy in front (``deploy/envoy/envoy.yaml``), and the EPP run in this process
on its own thread with each ext_proc message timed as the stream loop handles it. Sequential
streamed 8-token completions; per request, milliseconds from the client's send to: the request
headers reaching the EPP's handler, the body reaching it, the decision answered, the response
headers reaching it, the first response chunk reaching it, and the first token at the client.
Medians over ``--requests`` after ``--warmup``.

    python -m chaos.bench.epp_stages --requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

__all__ = ["main"]

STAGES = ("request_headers", "request_body", "decided", "response_headers", "response_body")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.bench.epp_stages",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        raise SystemExit("--requests must be >= 1 and --warmup >= 0")
    from chaos.envoy_front import envoy_child
    from chaos.ports import free_port
    from chaos.topology import Topology, TopologySpec
    from guard.config import GuardConfig
    from guard.epp import processor
    from guard.epp.server import EppServer

    marks: dict[str, float] = {}
    answer = processor._Stream.answer

    async def timed(stream, message):  # the first of each kind, in and answered
        kind = message.WhichOneof("request")
        marks.setdefault(kind, time.perf_counter())
        out = await answer(stream, message)
        if kind == "request_body":
            marks.setdefault("decided", time.perf_counter())
        return out
    processor._Stream.answer = timed

    with Topology(TopologySpec(num_replicas=1)) as fleet:
        port = free_port()
        config = GuardConfig.from_dict(
            {"replicas": ({"replica_id": "r0", "url": fleet.replica_urls[0]},)})
        server = EppServer(config)
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            await server.start("127.0.0.1", port)
            ready.set()
            await server.wait_stopped()
        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        ready.wait(60)
        envoy = envoy_child([port], Path(tempfile.mkdtemp())).start(60)
        samples: dict[str, list[float]] = {name: [] for name in (*STAGES, "client_first_token")}
        body = {"model": "llama-7b", "prompt": "hi", "max_tokens": 8, "stream": True}
        try:
            with httpx.Client(timeout=30.0, trust_env=False) as client:
                for i in range(args.warmup + args.requests):
                    marks.clear()
                    sent_s, first_s = time.perf_counter(), None
                    with client.stream("POST", envoy.url + "/v1/completions", json=body) as s:
                        for chunk in s.iter_raw():
                            if first_s is None and b'"text"' in chunk:
                                first_s = time.perf_counter()
                    if i < args.warmup or first_s is None:
                        continue
                    for name in STAGES:
                        samples[name].append(1000 * (marks[name] - sent_s))
                    samples["client_first_token"].append(1000 * (first_s - sent_s))
        finally:
            envoy.close()
            loop.call_soon_threadsafe(server.drain)
            loop.call_soon_threadsafe(server.drain)  # the second call stops at once
            thread.join(30)
    for name, values in samples.items():
        print(f"{name:<20} median {statistics.median(values):7.2f} ms after the client's send")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
