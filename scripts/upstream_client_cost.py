"""What one upstream request costs the proxy's upstream client, per ``upstream_client``: the
proxy's :class:`guard.proxy.transports.Transport` alone (no server, no admission) against a raw
asyncio SSE server on loopback in another process.

    python scripts/upstream_client_cost.py [--clients aiohttp,h1] [--streams 1000]
                                           [--callgrind]

Per client, in a fresh process: ``--streams`` sequential streamed POSTs (8 token events and
``[DONE]``, each its own chunk, 0.5 ms apart) read to the end, then as many small GETs (a state
poll's shape); printed: the client process's CPU time per stream and per GET
(``time.process_time``: other load on the machine inflates it far less than wall time).
``--callgrind`` counts instructions instead (valgrind's callgrind, the same under any load):
the difference between a run of 50 and one of 250 streams (and GETs), per request.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_SERVER = r'''
import asyncio, sys
EVENTS = [b'data: {"choices": [{"text": "tok%d"}]}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]
async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 2\r\n\r\n{}")
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for event in EVENTS:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.0005)
            writer.write(b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
'''

_CLIENT = r'''
import asyncio, sys, time
from guard.proxy.transports import make_transport
name, port, num = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def main():
    transport = make_transport(name, 5.0, 60.0, 256, 1)
    url = f"http://127.0.0.1:{port}"
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"g-1")]
    body = b'{"model": "m", "prompt": "hello", "stream": true}'
    async def stream():
        response = await transport.send(url + "/v1/completions", headers, body)
        async for _ in response.chunks():
            pass
        await response.aclose()
    for _ in range(20):
        await stream()
        await transport.get(url + "/kvguard/state", 2.0)
    started = time.process_time()
    for _ in range(num):
        await stream()
    streamed = time.process_time()
    for _ in range(num):
        await transport.get(url + "/kvguard/state", 2.0)
    done = time.process_time()
    await transport.aclose()
    print(f"{1e6 * (streamed - started) / num:.1f} {1e6 * (done - streamed) / num:.1f}")
asyncio.run(main())
'''


def _instructions(client: str, port: str, num: int, env: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, "-c", _CLIENT, client, port, str(num)],
                       check=True, capture_output=True, env=env)
        summary = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
        return int(summary.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="aiohttp,h1")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        for client in args.clients.split(","):
            if args.callgrind:  # the same requests twice: (250 - 50) streams and GETs apart
                small, large = (_instructions(client, port, n, env) for n in (50, 250))
                print(f"{client:8s} {(large - small) / 200 / 1000:8.0f} k instructions per "
                      "stream + GET pair")
                continue
            line = subprocess.run([sys.executable, "-c", _CLIENT, client, port,
                                   str(args.streams)], check=True, capture_output=True,
                                  text=True, env=env).stdout.split()
            print(f"{client:8s} {float(line[0]):8.1f} µs CPU per stream  "
                  f"{float(line[1]):7.1f} µs CPU per GET")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
