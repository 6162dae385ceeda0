"""``python -m chaos.bench.ext_proc_floor``: the least an ext_proc endpoint picker can do.

A baseline for ``kvguard bench gateway``: an ``envoy.service.ext_proc.v3.ExternalProcessor``
on grpc.aio that speaks the same protocol as ``kvguard epp`` with the same processing modes
(``deploy/envoy/envoy.yaml``: both bodies ``FULL_DUPLEX_STREAMED``) and decides nothing: every
request goes to ``--endpoint``, its body re-emitted, every response message passed back
unchanged. What Envoy + this adds over Envoy alone is the protocol's own cost from Python
(the gRPC stream per request, the round trips before the first token); what ``kvguard epp``
adds beyond it is its own work.

    python -m chaos.bench.ext_proc_floor --endpoint 127.0.0.1:8001 --port 0 [--loop uvloop]

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
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop (default: auto, uvloop when installed)")
    args = parser.parse_args(argv)
    from chaos.replica import exit_on_sigterm
    from serving.h1server import event_loop_runner

    exit_on_sigterm()
    return event_loop_runner(args.loop)(_serve(args.endpoint, args.host, args.port))


async def _serve(endpoint: str, host: str, port: int) -> int:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    from guard.epp import messages
    from guard.epp.picker import Route

    class Floor(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC name
            chunks: list[bytes] = []
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "response_body":
                    body = message.response_body
                    yield messages.response_body_answer(body.body, body.end_of_stream)
                elif kind == "response_headers":
                    yield messages.response_headers_answer(())
                elif kind == "request_body":
                    chunks.append(message.request_body.body)
                    if message.request_body.end_of_stream:
                        route = Route(endpoint, "r0", b"".join(chunks))
                        yield messages.request_headers_answer(route)
                        for piece in messages.body_chunks(route.body):
                            yield piece
                elif kind == "request_headers" and message.request_headers.end_of_stream:
                    yield messages.request_headers_answer(Route(endpoint, "r0", b""))
                elif kind in ("request_trailers", "response_trailers"):
                    yield messages.trailers_answer(kind == "response_trailers")

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"ext_proc floor listening on grpc://{host}:{bound}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
