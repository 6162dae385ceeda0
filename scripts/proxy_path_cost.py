"""What ``kvguard proxy`` adds to one streamed request at low load, with the noise of a shared
machine kept small: a raw asyncio SSE upstream (no engine, no sim), a raw-socket client in this
process, one request at a time, the targets interleaved request by request (the order rotates
every round, with a ``--gap-ms`` pause before each request so that the work a proxy does after
its response, the release, never overlaps the next target's request).

    python scripts/proxy_path_cost.py [--proxy NAME=CHECKOUT ...] [--floor] [--rounds 1000]
        [--tail together|apart|sim] [--slo NAME ...]
        [--strace NAME=OUT ...] [--pyspy NAME=OUT] [--callgrind] [--profile NAME]

Targets: ``direct`` (the upstream itself), each ``--proxy`` (``kvguard proxy``, ``always_admit``
— ``slo`` when named with ``--slo NAME``, then polling the upstream's ``/kvguard/state``: an
idle sim replica's —
``--http kvguard`` on asyncio — on uvloop when named with ``--uvloop NAME`` — with the
default upstream client, run from CHECKOUT: a kvguard
source tree, so two versions are measured in one interleaved run; default one proxy, ``this``,
from this checkout), and with ``--floor`` HTTP/1.1 relayed on raw asyncio protocols
(``chaos.passthrough --mode http``). The upstream streams one SSE event per token: the
response head, 1 ms later the first token, then 7 more and ``[DONE]`` (``asyncio.sleep(0.0002)``
apart, ~1 ms in practice), and the chunked terminator in the same write as ``[DONE]`` (``--tail
apart``: ~40 µs later in a write of its own, as uvicorn, vLLM and kvguard's engine end a
stream; ``--tail sim``: that, and ``[DONE]`` ~50 µs after the last token, the three close
writes that end a sim replica's stream). The proxies run with ``--state-source none`` (no state polls over
HTTP beside the requests).

Printed per target: TTFT (the first content event at the client) and end-to-end (the final
chunk) p50 / p99, what each adds to ``direct`` (each round's target minus that round's direct
request, then the percentile, so drift between rounds cancels), and the process's CPU time per
request (``/proc``: user + system over the measured rounds, background work included).

``--strace NAME=OUT``: count proxy NAME's system calls over the warm-up and the rounds
(``strace -c``; ``epoll_wait`` calls are event-loop iterations). ``--pyspy NAME=OUT``: sample it
with py-spy (``PYSPY``: the binary) into collapsed stacks. ``--callgrind``: each proxy instead
runs under valgrind's callgrind (its loop-lag sampler off), twice (``--rounds`` / 5 and
``--rounds`` requests); the difference over the extra requests is its instructions per
request (about ±4 % from run to run: what arrives in one read depends on timing).
``--profile NAME``: the proxy NAME under cProfile; its top functions by own time.
``--idle-s S``: instead, each proxy's CPU while idle (no request) over ``S`` seconds, after a
few requests: what its timers and polls cost.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_UPSTREAM = r'''
import asyncio, sys
TAIL = sys.argv[1] if len(sys.argv) > 1 else "together"
EVENTS = [b'data: {"choices": [{"text": "tok%d"}]}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]
# an idle sim replica's /kvguard/state (llama-7b on a simulated H100), for --policy slo
STATE = (b'{"model":"llama-7b","backend":"sim","max_model_len":4096,"block_size":16,'
         b'"num_total_blocks":29132,"num_free_blocks":29132,"max_num_seqs":256,'
         b'"max_num_batched_tokens":2048,"num_preemptions":0,"step_count":0,"now_s":1.0,'
         b'"running":[],"waiting":[],"iterations":[],"timing_model":{"kind":"roofline",'
         b'"step_time_prior":{"base_s":0.0041,"per_prefill_token_s":1.86e-05,'
         b'"per_decode_seq_s":4.2e-06,"per_context_token_s":3.9e-08}},"time_scale":1.0,'
         b'"admitting":true,"num_in_flight":0}')
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
class Upstream(asyncio.Protocol):
    def connection_made(self, transport):
        self.t = transport
        self.buf = b""
        transport.get_extra_info("socket").setsockopt(6, 1, 1)  # TCP_NODELAY
    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            if head.startswith(b"GET /kvguard/state"):
                self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(STATE), STATE))
            elif head.startswith(b"GET"):
                self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 35\r\n\r\n"
                             b'{"object": "list", "data": [], "ok": 1}'[:35])
            else:
                asyncio.ensure_future(self.stream())
    async def stream(self):
        self.t.write(HEAD)
        await asyncio.sleep(0.001)
        for i, event in enumerate(EVENTS):
            if i:  # sim: [DONE] right behind the last token, as a sim replica writes it
                await asyncio.sleep(0.00005 if TAIL == "sim" and i == len(EVENTS) - 1
                                    else 0.0002)
            self.t.write(b"%x\r\n%s\r\n" % (len(event), event))
        if TAIL != "together":  # as uvicorn, vLLM and kvguard's engine end a stream: its own
            await asyncio.sleep(0.00004)  # write, a moment later
        self.t.write(b"0\r\n\r\n")
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
'''

_PROFILE = r'''
import cProfile, pstats, signal, sys
from guard.cli import main
profiler = cProfile.Profile()
def stop(*_):
    raise KeyboardInterrupt
sys.argv = ["kvguard"] + sys.argv[1:]
profiler.enable()
try:
    main()
except (KeyboardInterrupt, SystemExit):
    pass
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
'''

# --callgrind: the proxy without its loop-lag sampler (100 wake-ups a second: under valgrind's
# slowdown they would be counted per request)
_QUIET = r'''
import asyncio, sys
import guard.observe.loop_lag
async def _idle(self, max_samples=None):
    await asyncio.Event().wait()
guard.observe.loop_lag.LoopLag.run = _idle
guard.observe.loop_lag.LoopLag.start = lambda self, *args, **kwargs: None  # the timer-callback sampler
from guard.cli import main
sys.exit(main(sys.argv[1:]))
'''

_CONTENT = re.compile(rb'"text"\s*:\s*"(?!")')
_BODY = (b'{"model": "llama-7b", "prompt": "The proxy path says hello", "max_tokens": 8, '
         b'"stream": true}')


def _request(port: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (port, len(_BODY), _BODY))


class Target:
    def __init__(self, name: str, port: int, pid: int | None) -> None:
        self.name, self.port, self.pid = name, port, pid
        self.request = _request(port)
        self.sock: socket.socket | None = None
        self.samples: list[tuple[float, float]] = []

    def connect(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def one(self) -> tuple[float, float]:
        sock = self.sock
        sent_ns = time.perf_counter_ns()
        sock.sendall(self.request)
        data = b""
        ttft_ns = None
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"{self.name}: connection closed")
            data += chunk
            if ttft_ns is None and _CONTENT.search(data):
                ttft_ns = time.perf_counter_ns() - sent_ns
            if data.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" in data:
                break
        e2e_ns = time.perf_counter_ns() - sent_ns
        if not data.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{self.name}: {data[:200]!r}")
        return ttft_ns / 1e6, e2e_ns / 1e6


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(cmd: list[str], pattern: str, env: dict | None = None, **kw) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, **kw)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        match = re.search(pattern, line)
        if match:
            return proc, int(match.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{cmd}: did not start")


def _proxy_cmd(checkout: Path, upstream: int, wrap: list[str],
               runner: str | None = None, loop: str = "asyncio",
               policy: str = "always_admit") -> tuple[list[str], dict]:
    """The command of one target; ``runner``: a script run in place of ``-m guard.cli``
    (its arguments the same), e.g. to patch the proxy before it starts; ``loop``: its
    ``--loop``; ``policy``: its policy (any but ``always_admit`` polls the upstream's
    ``/kvguard/state``)."""
    runner = runner or os.environ.get("PROXY_RUNNER")
    if str(checkout) == "floor":  # the raw-protocol HTTP relay of this checkout
        return [*wrap, sys.executable, "-m", "chaos.passthrough", "--mode", "http",
                "--upstream", f"http://127.0.0.1:{upstream}", "--port", "0"], {}
    config = Path(tempfile.mkdtemp(prefix="proxypath-")) / "proxy.toml"
    config.write_text(f'policy = "{policy}"\n')
    entry = [runner] if runner else ["-m", "guard.cli"]
    cmd = [*wrap, sys.executable, "-P", *entry, "proxy", "--upstream",
           f"http://127.0.0.1:{upstream}", "--state-source",
           "none" if policy == "always_admit" else "kvguard", "--config", str(config),
           "--http", "kvguard", "--loop", loop, "--port", "0"]
    return cmd, {"PYTHONPATH": str(checkout.resolve())}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency(args, upstream: int, procs: list) -> None:
    targets = [Target("direct", upstream, None)]
    for name, checkout in args.proxy:
        cmd, env = _proxy_cmd(checkout, upstream, [],
                              loop="uvloop" if name in args.uvloop else "asyncio",
                              policy="slo" if name in args.slo else "always_admit")
        proc, port = _start(cmd, r"listening on http://127\.0\.0\.1:(\d+)", env)
        procs.append(proc)
        targets.append(Target(name, port, proc.pid))
    if args.floor:
        proc, port = _start([sys.executable, "-m", "chaos.passthrough", "--mode", "http",
                             "--upstream", f"http://127.0.0.1:{upstream}", "--port", "0"],
                            r"listening on http://127\.0\.0\.1:(\d+)")
        procs.append(proc)
        targets.append(Target("floor: raw asyncio HTTP relay", port, proc.pid))
    for target in targets:
        target.connect()
    tracers = []
    for spec in args.strace:
        name, out = spec.split("=", 1)
        pid = next(t.pid for t in targets if t.name == name)
        tracers.append(subprocess.Popen(["strace", "-c", "-o", out, "-p", str(pid)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    spy = None
    if args.pyspy:
        name, out = args.pyspy.split("=", 1)
        pid = next(t.pid for t in targets if t.name == name)
        spy = subprocess.Popen([os.environ.get("PYSPY", "py-spy"), "record", "-r", "997", "-f", "raw",
                                "-o", out, "-p", str(pid), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    for _ in range(args.warmup):
        for target in targets:
            target.one()
    cpu0 = {t.name: _cpu_s(t.pid) for t in targets if t.pid}
    load = os.getloadavg()
    for i in range(args.rounds):
        shift = i % len(targets)
        for target in targets[shift:] + targets[:shift]:
            time.sleep(args.gap_ms / 1000)  # the last target's after-work (release) is done
            target.samples.append(target.one())
    cpu1 = {t.name: _cpu_s(t.pid) for t in targets if t.pid}
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    for tracer in tracers:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=60)
    direct = targets[0].samples
    print(f"{args.rounds} rounds, load average before {load[0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'target':34} {'TTFT p50':>9} {'p99':>7} {'e2e p50':>8} {'p99':>7} | "
          f"{'added TTFT p50':>14} {'p99':>6} {'added e2e p50':>13} {'p99':>6} | CPU ms/req")
    for target in targets:
        ttft = [s[0] for s in target.samples]
        e2e = [s[1] for s in target.samples]
        add_t = [s[0] - d[0] for s, d in zip(target.samples, direct, strict=True)]
        add_e = [s[1] - d[1] for s, d in zip(target.samples, direct, strict=True)]
        cpu = (1000 * (cpu1[target.name] - cpu0[target.name]) / args.rounds
               if target.pid else float("nan"))
        print(f"{target.name:34} {statistics.median(ttft):9.3f} {_pct(ttft, .99):7.3f} "
              f"{statistics.median(e2e):8.3f} {_pct(e2e, .99):7.3f} | "
              f"{statistics.median(add_t):14.3f} {_pct(add_t, .99):6.3f} "
              f"{statistics.median(add_e):13.3f} {_pct(add_e, .99):6.3f} | {cpu:.3f}")


def _callgrind(args, upstream: int, procs: list) -> None:
    for name, checkout in args.proxy:
        counts = []
        for rounds in (args.rounds // 5, args.rounds):
            out = Path(tempfile.mkdtemp(prefix="proxypath-cg-")) / "cg.out"
            quiet = out.parent / "quiet.py"
            quiet.write_text(_QUIET)
            cmd, env = _proxy_cmd(checkout, upstream, [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"], str(quiet),
                policy="slo" if name in args.slo else "always_admit")
            proc, port = _start(cmd, r"listening on http://127\.0\.0\.1:(\d+)", env)
            target = Target(name, port, proc.pid)
            target.connect()
            for _ in range(rounds):
                target.one()
            target.sock.close()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
            text = out.read_text(errors="replace")
            match = re.search(r"^summary:\s+(\d+)", text, re.M) or \
                re.search(r"^totals:\s+(\d+)", text, re.M)
            counts.append(int(match.group(1)))
        per = (counts[1] - counts[0]) / (args.rounds - args.rounds // 5)
        print(f"{name}: {per / 1000:.1f} k instructions per request "
              f"({counts[0]} at {args.rounds // 5}, {counts[1]} at {args.rounds})", flush=True)


def _idle(args, upstream: int, procs: list) -> None:
    targets = []
    for name, checkout in args.proxy:
        cmd, env = _proxy_cmd(checkout, upstream, [],
                              loop="uvloop" if name in args.uvloop else "asyncio",
                              policy="slo" if name in args.slo else "always_admit")
        proc, port = _start(cmd, r"listening on http://127\.0\.0\.1:(\d+)", env)
        procs.append(proc)
        targets.append(Target(name, port, proc.pid))
    for target in targets:
        target.connect()
        for _ in range(20):
            target.one()
    time.sleep(1.0)  # the last request's after-work
    cpu0 = {t.name: _cpu_s(t.pid) for t in targets}
    time.sleep(args.idle_s)
    for target in targets:
        cpu_ms = 1000 * (_cpu_s(target.pid) - cpu0[target.name]) / args.idle_s
        print(f"{target.name}: {cpu_ms:.1f} ms of CPU a second while idle "
              f"(over {args.idle_s:g} s; /proc ticks: ±{1000 / os.sysconf('SC_CLK_TCK') / args.idle_s:.1f})")


def _profile(args, upstream: int, procs: list) -> None:
    checkout = dict(args.proxy)[args.profile]
    script = Path(tempfile.mkdtemp(prefix="proxypath-prof-")) / "prof.py"
    script.write_text(_PROFILE)
    cmd, env = _proxy_cmd(checkout, upstream, [], str(script),
                          policy="slo" if args.profile in args.slo else "always_admit")
    proc, port = _start(cmd, r"listening on http://127\.0\.0\.1:(\d+)", env)
    target = Target(args.profile, port, proc.pid)
    target.connect()
    for _ in range(args.rounds):
        target.one()
    target.sock.close()
    proc.send_signal(signal.SIGINT)
    print(proc.communicate(timeout=120)[0][-12000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", action="append", default=[], metavar="NAME=CHECKOUT")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--uvloop", action="append", default=[], metavar="NAME",
                        help="proxy NAME runs on uvloop (--loop uvloop); the others on asyncio")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--gap-ms", type=float, default=3.0,
                        help="pause before each request, so that the previous target's work "
                             "after its response (release, pool) does not overlap the next")
    parser.add_argument("--slo", action="append", default=[], metavar="NAME",
                        help="proxy NAME runs the slo policy, polling the upstream's "
                             "/kvguard/state (an idle sim replica's); the others always_admit")
    parser.add_argument("--tail", choices=("together", "apart", "sim"), default="together",
                        help="the upstream writes the chunked terminator with the [DONE] event "
                             "(together) or ~40 us after it in a write of its own (apart: what "
                             "uvicorn, vLLM and kvguard's engine do); sim: also [DONE] ~50 us "
                             "after the last token, the three writes of a sim replica's end")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--profile", default=None, metavar="NAME")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="measure each proxy's CPU while idle over this many seconds instead")
    parser.add_argument("--strace", action="append", default=[], metavar="NAME=OUT",
                        help="count proxy NAME's system calls (strace -c) over the warm-up and "
                             "the rounds into OUT")
    parser.add_argument("--pyspy", default=None, metavar="NAME=OUT",
                        help="sample proxy NAME with py-spy (PYSPY: its path) into OUT "
                             "(collapsed stacks) over the rounds")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    args.proxy = [(p.split("=", 1)[0], Path(p.split("=", 1)[1])) for p in args.proxy] or \
        [("this", here)]
    for option in ("uvloop", "slo"):
        unknown = set(getattr(args, option)) - {name for name, _ in args.proxy}
        if unknown:
            parser.error(f"--{option} {', '.join(sorted(unknown))}: no --proxy of that name")
    upstream_proc = subprocess.Popen([sys.executable, "-c", _UPSTREAM, args.tail],
                                     stdout=subprocess.PIPE, text=True)
    upstream = int(upstream_proc.stdout.readline())
    procs: list[subprocess.Popen] = [upstream_proc]
    try:
        if args.idle_s > 0:
            _idle(args, upstream, procs)
        elif args.callgrind:
            _callgrind(args, upstream, procs)
        elif args.profile:
            _profile(args, upstream, procs)
        else:
            _latency(args, upstream, procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
