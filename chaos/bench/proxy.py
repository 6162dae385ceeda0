"""``kvguard bench proxy``: what ``kvguard proxy`` adds, next to LiteLLM proxy, in one run.

**Added latency.** One sim replica is reached directly and through each target, one streamed
completion of ``--max-tokens`` tokens at a time, the targets interleaved request by request so
drift hits them all alike: each round sends one request to every target in a shuffled order
(seeded, so runs repeat it), with a ``--gap-ms`` pause before each request, so the work a
process does after its response (a proxy's release, the replica finishing the sequence) never
overlaps the next target's request, and no target always follows the same one. Per target:
TTFT (first content token at the client) and end-to-end, median and p99; "added" is the
target's figure minus the direct one. Targets: ``kvguard proxy`` with
``always_admit`` and with ``slo`` (aiohttp upstream client, uvicorn on asyncio + h11), both
again on the proxy's defaults (``kvguard defaults ...``: kvguard's own HTTP server and the h1
client, on uvloop — what ``--loop auto`` picks, uvloop being a core dependency) and LiteLLM proxy (one worker, installed into ``.venv-litellm/``; ``--no-litellm`` skips it);
``--access-log`` adds both defaults again with ``kvguard proxy --access-log`` (one log line per
request, to the bench's pipe); ``--stacks`` adds ``always_admit`` with the h1 client (HTTP/1.1 on raw asyncio protocols), on uvloop + httptools (installed by the bench into ``.bench-site/`` when
the environment lacks them), the h1 client on those, and on kvguard's own HTTP server
(``--http kvguard``, on asyncio and on uvloop with the aiohttp client, on asyncio with the h1
client).
``--floor`` adds the trivial
pass-through proxies of :mod:`chaos.passthrough` (a TCP byte pump, HTTP/1.1 relayed on raw
asyncio protocols, and uvicorn + aiohttp with no admission; with ``--stacks`` that one on
uvloop + httptools too): what any Python proxy on these
stacks adds on this machine. ``--against DIR`` adds both policies' ``kvguard proxy`` run from
another checkout (``DIR``), so two versions of the proxy are measured in one interleaved run.

**Shedding.** The flood of ``kvguard bench sheds`` — open-loop arrivals of short streamed
prompts at ``--shed-rate`` req/s for ``--shed-duration-s`` (``0`` skips it), sent with
``chaos.raw_client`` and the sender's collector off — goes through ``kvguard proxy`` (``slo``,
its default h1 upstream client) to the same small, slow sim replica (4 sequences, time scale
20): almost everything is shed, and the proxy decides every request. Reported as by ``bench
sheds``: requests answered, sheds, connection-cap refusals, requests without an answer (must
be 0), shed latency p50/p99/max at the client, the proxy's event-loop lag, and the CPU per
request of the proxy process and of the sender (this process), with the sender's own warnings
when it fell behind. ``--shed-http`` (repeatable) runs it once per proxy HTTP server
(``kvguard proxy --http``; default ``kvguard``, the proxy's own default).
``--requests 0`` runs the shedding part alone. ``--defaults-only`` keeps, of kvguard's
variants, the two on the proxy's defaults; ``--copies N`` runs each kvguard variant in ``N``
processes (``name #2``, ...), since one process's median can sit apart from another's of the
same code.

Under CPU contention wall-clock figures swell; each target's CPU time per request (its process
tree's user + system seconds over the measured requests, background polling included) is
printed beside them as the steadier figure, net of the background CPU each process burns
while idle (measured over ``--idle-s`` first).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from chaos.bench.litellm_proxy import ensure_venv, litellm_child
from chaos.bench.sheds import configure as configure_sheds
from chaos.bench.sheds import engine_args, flood, loop_lag_max_s, shed_row
from chaos.bench.sheds import load_args as flood_load_args
from chaos.child import ChildProcess
from chaos.replica import exit_on_sigterm, write_guard_config
from chaos.report import read_records
from chaos.topology import Topology, TopologySpec, free_port, http_health

__all__ = ["configure", "round_orders", "run", "VARIANTS"]

MODEL = "llama-7b"
# name -> (policy, upstream client, uvicorn loop, uvicorn http)
VARIANTS = {
    "kvguard always_admit": ("always_admit", "aiohttp", "asyncio", "h11"),
    "kvguard slo": ("slo", "aiohttp", "asyncio", "h11"),
    # the proxy as it runs by default: kvguard's own HTTP server and the h1 client, on uvloop
    # (--loop auto picks it: a core dependency)
    "kvguard defaults always_admit": ("always_admit", "h1", "uvloop", "kvguard"),
    "kvguard defaults slo": ("slo", "h1", "uvloop", "kvguard"),
}
STACK_VARIANTS = {  # --stacks: the HTTP client and server stacks side by side
    "kvguard always_admit uvloop": ("always_admit", "aiohttp", "uvloop", "httptools"),
    "kvguard always_admit h1 client": ("always_admit", "h1", "asyncio", "h11"),
    "kvguard always_admit h1 client uvloop": ("always_admit", "h1", "uvloop", "httptools"),
    # kvguard's own HTTP/1.1 server (serving.h1server) in place of uvicorn
    "kvguard always_admit kvguard-http": ("always_admit", "aiohttp", "asyncio", "kvguard"),
    "kvguard always_admit kvguard-http uvloop": ("always_admit", "aiohttp", "uvloop",
                                                 "kvguard"),
    # both halves kvguard's own on asyncio (on uvloop: "kvguard defaults always_admit")
    "kvguard always_admit kvguard-http h1 client asyncio": ("always_admit", "h1", "asyncio",
                                                            "kvguard"),
}
ACCESS_LOG_VARIANTS = {  # --access-log: the proxy's defaults again, with --access-log on
    "kvguard defaults always_admit access-log": VARIANTS["kvguard defaults always_admit"],
    "kvguard defaults slo access-log": VARIANTS["kvguard defaults slo"],
}
FLOOR_VARIANTS = {  # --floor: name -> (chaos.passthrough mode, uvicorn loop, uvicorn http)
    "passthrough tcp": ("tcp", "asyncio", "h11"),
    "passthrough http (raw asyncio)": ("http", "asyncio", "h11"),
    "passthrough asgi": ("asgi", "asyncio", "h11"),
    "passthrough asgi uvloop": ("asgi", "uvloop", "httptools"),
}
_KEY = "sk-bench-" + secrets.token_hex(16)  # LiteLLM refuses to start without a master key
_CONTENT = re.compile(rb'"text"\s*:\s*"(?!")')


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300,
                        help="latency requests per target (0: skip the latency part)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests per target")
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="tokens per streamed completion")
    parser.add_argument("--stacks", action="store_true",
                        help="also run the h1/aiohttp client and uvloop+httptools variants")
    parser.add_argument("--defaults-only", action="store_true",
                        help="of kvguard's variants run only the proxy's defaults (both policies)")
    parser.add_argument("--copies", type=int, default=1,
                        help="run each kvguard variant in this many processes (a process's "
                             "median can sit apart from another's of the same code)")
    parser.add_argument("--gap-ms", type=float, default=3.0,
                        help="pause before each latency request (the last one's after-work "
                             "is done; 0: back to back)")
    parser.add_argument("--idle-s", type=float, default=3.0,
                        help="idle window that measures each process's background CPU")
    parser.add_argument("--access-log", action="store_true",
                        help="also run the proxy's defaults with --access-log (one log line "
                             "per request), beside the same without it")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM target")
    parser.add_argument("--floor", action="store_true",
                        help="also run trivial pass-through proxies (TCP pump, uvicorn+aiohttp)")
    parser.add_argument("--against", default=None, type=Path, metavar="DIR",
                        help="also run kvguard proxy from another checkout, side by side")
    parser.add_argument("--litellm-venv", default=".venv-litellm", type=Path,
                        help="the virtual environment LiteLLM is installed into")
    parser.add_argument("--bench-site", default=".bench-site", type=Path,
                        help="where uvloop/httptools go when the environment lacks them")
    parser.add_argument("--shed-rate", type=float, default=2000.0, help="req/s (0: skip)")
    parser.add_argument("--shed-duration-s", type=float, default=10.0,
                        help="how long the shedding flood runs")
    parser.add_argument("--shed-http", action="append", default=None,
                        choices=("auto", "h11", "httptools", "kvguard"),
                        help="the proxy's --http for the shedding run (repeatable: one run "
                             "each; default kvguard, the proxy's default)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.requests < 0 or args.warmup < 0 or args.max_tokens < 1 or args.shed_rate < 0 \
            or not args.gap_ms >= 0:
        raise ValueError("--max-tokens must be >= 1, --requests/--warmup/--shed-rate/--gap-ms "
                         ">= 0")
    if args.copies < 1:
        raise ValueError("--copies must be >= 1")
    if args.defaults_only and args.stacks:
        raise ValueError("--defaults-only leaves out the --stacks variants: pick one")
    if args.requests == 0 and args.shed_rate == 0:
        raise ValueError("--requests 0 and --shed-rate 0 leave nothing to measure")
    if args.against is not None and not (args.against / "guard" / "proxy").is_dir():
        raise ValueError(f"--against: {args.against} is not a kvguard checkout (no guard/proxy/)")
    out = Path(args.out) if args.out else None
    if out is not None:  # a bad path fails now, not after minutes of measuring
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder: name the JSON file to write")
        out.parent.mkdir(parents=True, exist_ok=True)
    exit_on_sigterm()
    results: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-proxy-") as work:
        if args.requests > 0:
            results["latency"] = _latency(args, Path(work))
            _print_latency(results["latency"])
        if args.shed_rate > 0:
            for http in args.shed_http or ["kvguard"]:
                key = "shedding" if http == "kvguard" else f"shedding {http}"
                results[key] = _shedding(args, Path(work), http)
                print(json.dumps({key: results[key]}, indent=2), flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=2))
    return 0


def _proxy_config(work: Path, policy: str, client: str) -> str:
    path = work / f"proxy-{policy}-{client}.toml"
    path.write_text(f'policy = "{policy}"\n[proxy]\nupstream_client = "{client}"\n')
    return str(path)


def _site_path(args: argparse.Namespace) -> str | None:
    """A directory with uvloop and httptools when the environment lacks them."""
    if importlib.util.find_spec("uvloop") and importlib.util.find_spec("httptools"):
        return None
    site = args.bench_site.resolve()
    if not (site / "uvloop").exists() or not (site / "httptools").exists():
        print(f"installing uvloop and httptools into {site} (bench only)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site),
                        "uvloop", "httptools"], check=True)
    return str(site)


def _env(loop: str, site: str | None, checkout: Path | None = None) -> dict[str, str]:
    """PYTHONPATH for a child: ``checkout`` (another version of kvguard) in place of ours, then
    the bench's uvloop/httptools site when the child runs on uvloop."""
    paths = [str(checkout.resolve()) if checkout is not None else os.environ.get("PYTHONPATH")]
    if site is not None and loop == "uvloop":
        paths.append(site)
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _proxy(upstream: str, config: str, loop: str, http: str, site: str | None,
           checkout: Path | None = None, extra: tuple[str, ...] = ()) -> ChildProcess:
    # -P for another checkout: the current directory is not put first on sys.path, so the
    # checkout's guard/ is the one imported
    isolate = ["-P"] if checkout is not None else []
    return ChildProcess(
        "proxy", lambda port: [sys.executable, *isolate, "-m", "guard.cli", "proxy", "--upstream",
                               upstream, "--config", config, "--loop", loop, "--http", http,
                               *extra, "--host", "127.0.0.1", "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)",
        env=_env(loop, site, checkout))


def _passthrough(upstream: str, mode: str, loop: str, http: str, site: str | None
                 ) -> ChildProcess:
    return ChildProcess(
        "passthrough", lambda port: [sys.executable, "-m", "chaos.passthrough", "--mode", mode,
                                     "--upstream", upstream, "--loop", loop, "--http", http,
                                     "--port", str(port)],
        http_health, ready_pattern=r"passthrough listening on (\S+)", env=_env(loop, site))


def _latency(args: argparse.Namespace, work: Path) -> dict:
    spec = TopologySpec(num_replicas=1, replica_args=("--model", MODEL, "--backend", "sim"))
    children: list[ChildProcess] = []
    try:
        with Topology(spec) as fleet:
            upstream = fleet.replica_urls[0]
            urls = {"direct": upstream}
            ours, variants = _variants(args)
            site = _site_path(args) if args.stacks else None
            for name, (policy, client, loop, http) in variants.items():
                extra = ("--access-log",) if name.split(" #")[0] in ACCESS_LOG_VARIANTS else ()
                child = _proxy(upstream, _proxy_config(work, policy, client), loop, http, site,
                               extra=extra)
                children.append(child.start())
                urls[name] = child.url
            if args.against is not None:
                for name, (policy, client, loop, http) in _copies(ours, args.copies).items():
                    child = _proxy(upstream, _proxy_config(work, policy, client), loop, http,
                                   None, args.against)
                    children.append(child.start())
                    urls[f"{name} ({args.against.name})"] = child.url
            if args.floor:
                for name, (mode, loop, http) in FLOOR_VARIANTS.items():
                    if loop == "uvloop" and not args.stacks:
                        continue
                    children.append(_passthrough(upstream, mode, loop, http, site).start())
                    urls[name] = children[-1].url
            if not args.no_litellm:
                exe = ensure_venv(args.litellm_venv.resolve())
                child = litellm_child(exe, upstream, MODEL, free_port(), work, _KEY)
                children.append(child.start(timeout_s=180))
                urls["litellm"] = child.url
            pids = {"direct": fleet.replicas[0].pid}
            pids.update({name: c.pid for name, c in zip(list(urls)[1:], children, strict=True)})
            return _measure_all(urls, pids, args)
    finally:
        for child in children:
            child.terminate()


def _variants(args: argparse.Namespace) -> tuple[dict, dict]:
    """(kvguard's own variants, every kvguard target of this run), copies included in the
    second; ``--against`` runs the first from the other checkout."""
    ours = {name: variant for name, variant in VARIANTS.items()
            if not args.defaults_only or "defaults" in name}
    return ours, _copies({**ours, **(STACK_VARIANTS if args.stacks else {}),
                          **(ACCESS_LOG_VARIANTS if args.access_log else {})}, args.copies)


def _copies(variants: dict, copies: int) -> dict:
    """Each variant ``copies`` times, the second and later named ``<name> #2`` and so on."""
    return {(name if i == 0 else f"{name} #{i + 1}"): variant
            for name, variant in variants.items() for i in range(copies)}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (LiteLLM may fork a worker)."""
    process = psutil.Process(pid)
    total = 0.0
    for p in (process, *process.children(recursive=True)):
        times = p.cpu_times()
        total += times.user + times.system
    return total


def _measure_all(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace,
                 baseline: str | None = None) -> dict:
    """Each target's latency and CPU rows; with ``baseline`` (a target's name) each row also
    has the median over rounds of its TTFT and end-to-end minus the baseline's in the same
    round (``paired_*``): every round sends one request to each target, so a slow spell of
    the machine falls on both sides of each difference."""
    body = json.dumps({"model": MODEL, "prompt": "The proxy bench says hello",
                       "max_tokens": args.max_tokens, "stream": True}).encode()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
    headers = {"content-type": "application/json", "authorization": f"Bearer {_KEY}"}
    clients = {name: httpx.Client(base_url=url, timeout=60.0, trust_env=False, headers=headers)
               for name, url in urls.items()}
    try:
        for _ in range(args.warmup):
            for client in clients.values():
                _one_stream(client, body)
        idle_cpu_s = {name: _cpu_s(pid) for name, pid in pids.items()}
        time.sleep(args.idle_s)  # background work only: state polls, probes
        cpu_s = {name: _cpu_s(pid) for name, pid in pids.items()}
        idle_rate = {name: (cpu_s[name] - idle_cpu_s[name]) / args.idle_s for name in pids}
        gap_s = args.gap_ms / 1000
        started_s = time.perf_counter()
        for order in round_orders(list(clients), args.requests):
            for name in order:
                time.sleep(gap_s)  # the previous request's after-work is done
                samples[name].append(_one_stream(clients[name], body))
        busy_s = time.perf_counter() - started_s  # the gaps included: polls go on in them
        cpu_s = {name: _cpu_s(pid) - cpu_s[name] for name, pid in pids.items()}
    finally:
        for client in clients.values():
            client.close()
    rows = _summarise(samples)
    if baseline is not None:
        base = samples[baseline]
        for name, row in rows.items():  # samples[name][i] is round i's, for every target
            for index, key in ((0, "paired_ttft_p50_ms"), (1, "paired_e2e_p50_ms")):
                differences = [pair[index] - base_pair[index]
                               for pair, base_pair in zip(samples[name], base, strict=True)]
                row[key] = 1000 * statistics.median(differences)
    for name, row in rows.items():  # CPU time is what contention inflates least
        net_s = cpu_s[name] - idle_rate[name] * busy_s
        row["cpu_ms_per_request"] = 1000 * net_s / args.requests
        row["idle_cpu_ratio"] = idle_rate[name]
    return rows


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """Each round's order of the targets: shuffled, from a fixed seed (a run repeats it), so
    no target always follows the same one (what a process does after its response would
    otherwise fall on one neighbour's requests every time)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def _one_stream(client: httpx.Client, body: bytes) -> tuple[float, float]:
    sent_s = time.perf_counter()
    ttft_s = None
    with client.stream("POST", "/v1/completions", content=body) as response:
        tail = b""
        for chunk in response.iter_raw():
            if ttft_s is None and _CONTENT.search(chunk):
                ttft_s = time.perf_counter() - sent_s
            tail = (tail + chunk)[-64:]
        e2e_s = time.perf_counter() - sent_s
    if response.status_code != 200 or b"[DONE]" not in tail or ttft_s is None:
        raise RuntimeError(f"{client.base_url}: bad stream (HTTP {response.status_code})")
    return ttft_s, e2e_s


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summarise(samples: dict[str, list[tuple[float, float]]]) -> dict:
    out = {}
    for name, pairs in samples.items():
        ttft = [p[0] for p in pairs]
        e2e = [p[1] for p in pairs]
        out[name] = {"ttft_p50_ms": 1000 * statistics.median(ttft),
                     "ttft_p99_ms": 1000 * _pct(ttft, 0.99),
                     "e2e_p50_ms": 1000 * statistics.median(e2e),
                     "e2e_p99_ms": 1000 * _pct(e2e, 0.99), "n": len(pairs)}
    direct = out["direct"]
    for row in out.values():
        for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
            row["added_" + key] = row[key] - direct[key]
    return out


def _print_latency(rows: dict) -> None:
    print(f"{'target':<40} {'TTFT p50':>9} {'p99':>8} {'e2e p50':>9} {'p99':>8}   "
          f"{'added TTFT p50':>14} {'p99':>7} {'added e2e p50':>13} {'p99':>7} {'CPU/req':>8}"
          "  (ms)")
    for name, r in rows.items():
        print(f"{name:<40} {r['ttft_p50_ms']:9.2f} {r['ttft_p99_ms']:8.2f} {r['e2e_p50_ms']:9.2f} "
              f"{r['e2e_p99_ms']:8.2f}   {r['added_ttft_p50_ms']:14.2f} "
              f"{r['added_ttft_p99_ms']:7.2f} {r['added_e2e_p50_ms']:13.2f} "
              f"{r['added_e2e_p99_ms']:7.2f} {r['cpu_ms_per_request']:8.3f}")
    if "litellm" in rows:
        for name in [n for n in rows if n.startswith("kvguard")]:
            for key, what in (("added_e2e_p50_ms", "end-to-end latency"),
                              ("added_ttft_p50_ms", "time to first token")):
                ours, theirs = rows[name][key], rows["litellm"][key]
                ratio = theirs / ours if ours > 0 else float("inf")
                print(f"LiteLLM adds {ratio:.1f}x the median {what} of {name}")


def _shedding(args: argparse.Namespace, work: Path, http: str) -> dict:
    """The flood of ``kvguard bench sheds`` (its arrivals, raw sender with its collector off,
    small slow replica), sent through ``kvguard proxy`` (``slo``, its default h1 upstream
    client) on the ``http`` server: the proxy decides every request and sheds almost all."""
    parser = argparse.ArgumentParser()
    configure_sheds(parser)  # bench sheds' own defaults: replica, SLO, sender
    flood_args = parser.parse_args(["--rate", repr(args.shed_rate),
                                    "--duration", repr(args.shed_duration_s)])
    config = write_guard_config(str(work / f"proxy-shed-{http}.toml"), policy="slo",
                                ttft_s=flood_args.ttft, itl_s=flood_args.itl)  # bench sheds' guard
    spec = TopologySpec(num_replicas=1, num_proxies=1,
                        replica_args=tuple(engine_args(flood_args, None)),
                        proxy_args=("--config", config, "--http", http))
    out = work / f"shed-{http}"
    out.mkdir(parents=True, exist_ok=True)
    with Topology(spec) as fleet:
        proxy_pid = fleet.proxies[0].pid
        proxy_cpu0 = _cpu_s(proxy_pid)
        summary = flood(flood_load_args(fleet.proxy_urls[0], flood_args, out), args.shed_rate,
                        out)
        proxy_cpu_s = _cpu_s(proxy_pid) - proxy_cpu0
        metrics = httpx.get(fleet.proxy_urls[0] + "/kvguard/metrics", timeout=10.0,
                            trust_env=False).text
    row = shed_row(read_records(out / "requests.jsonl"), args.shed_rate, args.shed_duration_s)
    row["loop_lag_max_s"] = loop_lag_max_s(metrics)
    row["http"] = http
    row["proxy_cpu_us_per_request"] = round(proxy_cpu_s * 1e6 / max(1, row["offered"]), 1)
    gen = summary["load_generator"]
    row["sender_cpu_us_per_request"] = round(gen["cpu_s"] * 1e6 / max(1, row["offered"]), 1)
    row["sender_achieved_rps"] = summary["achieved_rate_per_s"]
    row["warnings"] = summary["warnings"]
    return row
