"""``python -m chaos.bench.ext_proc_floor``: the least an ext_proc endpoint picker can do.

A baseline for ``kvguard bench gateway``: an ``envoy.service.ext_proc.v3.ExternalProcessor``
on grpc.aio that speaks the same protocol as ``kvguard epp`` with the same processing modes
(``deploy/envoy/envoy.yaml``: both bodies ``FULL_DUPLEX_STREAMED``) and decides nothing: every
request goes to ``--endpoint``, its body re-emitted, every response message passed back
unchanged. What Envoy + this adds over Envoy alone is the protocol's own cost from Python
(the gRPC stream per request, the round trips before the first token); what ``kvguard epp``
adds beyond it is its own work.

    python -m chaos.bench.ext_proc_floor --endpoint 127.0.0.1:8001 --port 0 [--loop uvloop]
    python -m chaos.bench.ext_proc_floor --endpoint 127.0.0.1:8001 --server sync \
        --grpc-arg grpc.max_concurrent_streams=100

``--server sync`` serves on grpc's thread-pool server instead of grpc.aio (one thread per
stream, no event loop), ``--grpc-arg KEY=VALUE`` passes a server channel argument (repeatable;
integers as integers), ``--listen unix:/path`` binds a Unix socket instead of
``--host``/``--port``: the variants ``python -m chaos.bench.ext_proc_variants`` compares.

Prints ``ext_proc floor listening on grpc://127.0.0.1:PORT`` once it serves; serves gRPC
health (all SERVING) so that Envoy's health check of the EPP cluster passes.
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.bench.ext_proc_floor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="the replica, ip:port")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    parser.add_argument("--listen", default=None,
                        help="a gRPC address to bind instead (e.g. unix:/tmp/floor.sock)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop of the aio server (default: auto, uvloop when "
                             "installed)")
    parser.add_argument("--server", choices=("aio", "sync"), default="aio",
                        help="grpc.aio (default) or grpc's thread-pool server")
    parser.add_argument("--threads", type=int, default=16,
                        help="worker threads of the sync server (one per open stream)")
    parser.add_argument("--grpc-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a server channel argument (repeatable)")
    args = parser.parse_args(argv)
    from chaos.replica import exit_on_sigterm

    options = [("grpc.so_reuseport", 0), *(_grpc_arg(text) for text in args.grpc_arg)]
    address = args.listen or f"{args.host}:{args.port}"
    exit_on_sigterm()
    if args.server == "sync":
        return _serve_sync(args.endpoint, address, options, args.threads)
    from serving.h1server import event_loop_runner

    return event_loop_runner(args.loop)(_serve(args.endpoint, address, options))


def _grpc_arg(text: str) -> tuple[str, int | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--grpc-arg {text!r}: expected KEY=VALUE")
    return key, int(value) if value.lstrip("-").isdigit() else value


class _Answers:
    """The floor's answers to one ext_proc stream's messages, message by message."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.chunks: list[bytes] = []

    def to(self, message) -> list:
        from guard.epp import messages
        from guard.epp.picker import Route

        kind = message.WhichOneof("request")
        if kind == "response_body":
            body = message.response_body
            return [messages.response_body_answer(body.body, body.end_of_stream)]
        if kind == "response_headers":
            return [messages.response_headers_answer(())]
        if kind == "request_body":
            self.chunks.append(message.request_body.body)
            if not message.request_body.end_of_stream:
                return []
            route = Route(self.endpoint, "r0", b"".join(self.chunks))
            return [messages.request_headers_answer(route), *messages.body_chunks(route.body)]
        if kind == "request_headers" and message.request_headers.end_of_stream:
            return [messages.request_headers_answer(Route(self.endpoint, "r0", b""))]
        if kind in ("request_trailers", "response_trailers"):
            return [messages.trailers_answer(kind == "response_trailers")]
        return []


def _listening(address: str, bound: int) -> str:
    if address.startswith("unix:"):
        return address
    return f"grpc://{address.rpartition(':')[0]}:{bound}"


async def _serve(endpoint: str, address: str, options: list) -> int:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    class Floor(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC name
            answers = _Answers(endpoint)
            async for message in request_iterator:
                for answer in answers.to(message):
                    yield answer

    server = grpc.aio.server(options=options)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(address)
    await server.start()
    for service in _SERVICES:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"ext_proc floor listening on {_listening(address, bound)}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=None)
    return 0


def _serve_sync(endpoint: str, address: str, options: list, threads: int) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    class Floor(external_processor_pb2_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):  # noqa: N802 - the gRPC name
            answers = _Answers(endpoint)
            for message in request_iterator:
                yield from answers.to(message)

    server = grpc.server(ThreadPoolExecutor(max_workers=threads), options=options)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(address)
    server.start()
    for service in _SERVICES:
        servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"ext_proc floor listening on {_listening(address, bound)}", flush=True)
    try:
        server.wait_for_termination()
    finally:
        server.stop(grace=None)
    return 0


_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


if __name__ == "__main__":
    raise SystemExit(main())
