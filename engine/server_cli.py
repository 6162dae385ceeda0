"""``kvguard engine``: serve one engine replica over OpenAI-compatible HTTP.

Prints ``kvguard engine listening on http://HOST:PORT`` once it accepts connections (``--port 0``
prints the port the OS chose). SIGTERM/SIGINT: first run the drain hooks that middleware
registered (``serving.drain_hooks``: the guard stops admitting and lets its streams finish),
then stop admitting (new requests get 503), let in-flight requests finish for
``--shutdown-timeout-s``, abort the rest, exit 0; a second signal exits at once.

``--middleware module:Class`` wraps the app with any ASGI middleware class taking ``app`` as
its only required argument (repeatable; the first listed is the outermost). ``--guard CONFIG``
is shorthand for ``--middleware guard.middleware:AdmissionMiddleware`` with ``KVGUARD_CONFIG``
set to CONFIG, mounted outermost; the engine package itself never imports ``guard``.

``--http`` picks the HTTP server: uvicorn with h11 (the default) or httptools, or ``kvguard``,
kvguard's own HTTP/1.1 server on asyncio protocols (``serving.h1server``). Slow or greedy
clients are bounded by ``serving.ServerLimits`` (``--header-timeout-s``,
``--body-timeout-s``, ``--keep-alive-timeout-s``, ``--max-connections``,
``--max-connections-per-client``); connections it closes are counted in
``kvguard_engine_connections_closed_total{reason}``. Writes to clients that went away and
invalid HTTP requests are counted and summarised in one log line a minute, not logged one by one
(``serving.quiet_log``).

The prefix cache is on unless ``--no-enable-prefix-caching``. ``--kv-events-endpoint
tcp://127.0.0.1:PORT`` publishes KV-cache events there in vLLM's format
(``engine.kv_event_publisher``; ``tcp://127.0.0.1:*`` picks a free port) and advertises the
bound address in ``/kvguard/state`` as ``kv_events_endpoint``; ``--kv-events-replay-endpoint``
adds vLLM's replay socket (``kv_events_replay_endpoint``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys

from serving import add_limit_arguments, install_quiet_logging, limits_from_args
from serving.log_format import LOG_FORMATS, configure_logging

__all__ = ["configure", "run", "load_middleware"]

GUARD_MIDDLEWARE = "guard.middleware:AdmissionMiddleware"
# read before the server starts, so a bad --guard config is one line (the CLI's ValueError),
# not a traceback from the server's start-up; imported by name like the middleware
GUARD_CONFIG_LOADER = "guard.config:load_config"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model preset (tiny, smollm2-135m, "
                        "llama-7b, ...)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as 'model' (default: --model)")
    parser.add_argument("--backend", choices=("torch", "sim"), default="torch",
                        help="torch runs the model; sim models a GPU's step times")
    parser.add_argument("--gpu", default="h100-80g",
                        help="GPU the sim backend models; the power figures for modelled power "
                             "(sim and CPU backends)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sim backend: wall seconds per simulated second (0: no waiting)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="torch backend: where the model runs (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="torch backend: weight dtype (default: the device's)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV cache blocks (default: max-num-seqs full-length sequences, "
                             "at most 1 GiB; on CUDA at most 90%% of free memory)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: the preset's)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences per step (default: the preset's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step, the prefill chunk budget (default: the preset's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random weights of a preset without a checkpoint "
                             "(default: 0)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV blocks of cached prompt prefixes "
                        "(default: on)")
    parser.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="bind a ZMQ PUB socket here and publish KV-cache events in vLLM's "
                        "format (e.g. tcp://127.0.0.1:5557; off by default)")
    parser.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="bind a ZMQ ROUTER socket here that replays buffered event "
                        "batches from a requested sequence number (needs --kv-events-endpoint)")
    parser.add_argument("--kv-events-topic", default="",
                        help="topic frame of each KV event message (default: empty, as vLLM)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="append one JSON line per request to FILE")
    parser.add_argument("--step-trace", default=None, metavar="FILE",
                        help="append one JSON line per engine step (each request's tokens and "
                             "KV read: what cost accounting shares the step's time by) to FILE")
    parser.add_argument("--middleware", action="append", default=[], metavar="MODULE:CLASS",
                        help="ASGI middleware to wrap the app with (repeatable)")
    parser.add_argument("--guard", default=None, metavar="CONFIG",
                        help="mount the kvguard admission middleware with this config file")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="largest generation request body; more is a 413 (default 1 MiB, "
                        "the guard's max_body_bytes)")
    parser.add_argument("--shutdown-timeout-s", type=float, default=10.0,
                        help="SIGTERM: how long running requests may still run")
    parser.add_argument("--log-level", default="warning",
                        help="debug, info (lifecycle events), warning or error")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="log lines as text or one JSON object each, with a UTC timestamp")
    parser.add_argument("--http", choices=("h11", "httptools", "auto", "kvguard"),
                        default="h11",
                        help="HTTP server: uvicorn with its h11 (default) or httptools parser "
                             "(auto: httptools when installed), or kvguard's own HTTP/1.1 "
                             "server (serving.h1server)")
    add_limit_arguments(parser)


def _overrides(args: argparse.Namespace) -> dict:
    names = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
             "max_model_len", "seed")
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    overrides["enable_prefix_caching"] = args.enable_prefix_caching
    return overrides


def _kv_event_publisher(args: argparse.Namespace, engine):
    """The KV event publisher the flags ask for, attached to ``engine``, or None."""
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    from engine.kv_event_publisher import KVEventPublisher

    publisher = KVEventPublisher(args.kv_events_endpoint, topic=args.kv_events_topic,
                                 replay_endpoint=args.kv_events_replay_endpoint)
    engine.attach_kv_event_sink(publisher.publish, publisher.endpoint, publisher.replay_endpoint)
    return publisher


def _build_engine(args: argparse.Namespace):
    if args.backend == "sim":
        from engine.sim_runner import build_sim_engine

        return build_sim_engine(args.model, gpu=args.gpu, time_scale=args.time_scale,
                                **_overrides(args))
    from engine.llm_engine import LLMEngine

    overrides = _overrides(args)
    if args.device is not None:
        overrides["device"] = args.device
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    return LLMEngine.from_preset(args.model, **overrides)


def _gpu_meter(engine, args: argparse.Namespace):
    """The replica's GPU meter: the ``--gpu`` kind's figures (measured power on CUDA)."""
    from engine.gpu_meter import GpuMeter, MemorySplit, nvml_power
    from engine.gpus import get_gpu

    cfg = engine.config
    memory = MemorySplit.plan(cfg.model, engine.num_total_blocks, cfg.cache.block_size,
                              cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
    measured = nvml_power() if args.backend == "torch" and args.device == "cuda" else None
    return GpuMeter(cfg.model, get_gpu(args.gpu), memory, measured)


class _FoldedVocab:
    """A tokenizer whose ids are folded into a smaller model vocabulary (sim models only:
    their tokens carry no meaning, so any in-range id will do)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [i % self._vocab_size for i in self._tokenizer.encode(text, add_special_tokens)]

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def _tokenizer_for(engine, backend: str):
    """The engine's own tokenizer, else SmolLM2's (the tiny preset shares its vocabulary),
    else None (token-id prompts only)."""
    if engine.tokenizer is not None:
        return engine.tokenizer
    try:
        from engine.gguf_loader import find_smollm2_gguf
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(find_smollm2_gguf())
    except (ImportError, OSError, ValueError) as exc:
        print(f"kvguard engine: no tokenizer ({exc}); prompts must be token ids",
              file=sys.stderr)
        return None
    vocab_size = engine.config.model.vocab_size
    if tokenizer.vocab_size <= vocab_size:
        return tokenizer
    return _FoldedVocab(tokenizer, vocab_size) if backend == "sim" else None


def load_middleware(spec: str):
    """``module:Class`` → the class (ValueError with a clear message otherwise)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--middleware must look like module:Class, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import middleware module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


async def _drain(drain_hooks, async_engine, shutdown_timeout_s: float) -> None:
    """The guard (a drain hook) stops admitting first, then the engine drains."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + shutdown_timeout_s
    try:
        await asyncio.wait_for(drain_hooks.run_hooks(), shutdown_timeout_s)
    except asyncio.TimeoutError:
        pass
    num_aborted = await async_engine.shutdown(max(0.0, deadline_s - loop.time()))
    if num_aborted:
        print(f"kvguard engine: aborted {num_aborted} request(s) at shutdown",
              file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from engine.async_engine import AsyncEngine
    from engine.metrics import EngineMetrics
    from engine.server import build_app
    from engine.trace import TraceWriter
    from serving.drain_hooks import DrainHooks
    from serving.draining_server import draining_server, listening_socket
    from serving.limited_protocol import ConnectionTable, uvicorn_config

    configure_logging(args.log_level, args.log_format)
    limits = limits_from_args(args)
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    specs = list(args.middleware)
    if args.guard is not None:
        os.environ["KVGUARD_CONFIG"] = args.guard
        load_middleware(GUARD_CONFIG_LOADER)()  # a bad config: ValueError naming the key
        specs.insert(0, GUARD_MIDDLEWARE)  # outermost: it sees every request first
    middlewares = [load_middleware(s) for s in specs]
    if args.time_scale < 0:
        raise ValueError(f"--time-scale must be >= 0, got {args.time_scale}")
    engine = _build_engine(args)
    publisher = _kv_event_publisher(args, engine)
    tokenizer = _tokenizer_for(engine, args.backend)
    name = args.served_model_name or args.model
    metrics = EngineMetrics(CollectorRegistry(), name)

    trace = TraceWriter.open(args.trace) if args.trace else None
    step_trace = TraceWriter.open(args.step_trace) if args.step_trace else None

    meter = _gpu_meter(engine, args)
    metrics.attach_gpu_meter(meter)

    def on_step(result, state) -> None:
        num_prefill = result.iteration.num_prefill_tokens if result.iteration else 0
        metrics.record_tokens(num_prefill, sum(len(o.new_token_ids) for o in result.outputs))
        if result.iteration is not None:
            meter.on_step(result.work, result.iteration.duration_s)
        if step_trace is not None:
            step_trace.write_step(result)

    async_engine = AsyncEngine(engine, on_step=on_step)
    app = build_app(async_engine, name, tokenizer, metrics, trace,
                    max_body_bytes=args.max_body_bytes)
    for middleware in reversed(middlewares):
        app.add_middleware(middleware)
    app = DrainHooks(app)  # outermost: it publishes the hook list in the lifespan state
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    table = ConnectionTable(limits, on_close=metrics.record_connection_closed)
    drain = lambda: _drain(app, async_engine, args.shutdown_timeout_s)  # noqa: E731
    ready_line = f"kvguard engine listening on {url}"
    graceful_timeout_s = max(1, int(args.shutdown_timeout_s))
    install_quiet_logging()
    try:
        if args.http == "kvguard":
            return _run_h1server(app, table, sock, drain, ready_line, graceful_timeout_s)
        config = uvicorn_config(app, table, http=args.http, log_level=args.log_level,
                                access_log=False, lifespan="on",
                                timeout_graceful_shutdown=graceful_timeout_s)
        draining_server(config, drain, ready_line).run(sockets=[sock])
    finally:
        sock.close()
        for writer in (trace, step_trace):
            if writer is not None:
                writer.close()
        if publisher is not None:
            publisher.close()
    return 0


def _run_h1server(app, table, sock, drain, ready_line: str, graceful_timeout_s: float) -> int:
    """``--http kvguard``: the same app, limits, drain and ready line on serving.h1server."""
    from serving.h1server import H1Server
    from serving.h1server import run as serve

    server = H1Server(app, table, graceful_timeout_s=graceful_timeout_s)
    return 0 if serve(server, [sock], drain=drain, ready_line=ready_line) else 1
