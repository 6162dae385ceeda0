"""A replica that publishes no /kvguard/state: healthy, unknown capacity, the stale-state rule."""

import asyncio
import json
import uuid

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from guard.config import GuardConfig
from guard.middleware import AdmissionMiddleware
from guard.replicas.load_state import LoadState
from guard.replicas.poller import AsgiStateSource, HttpStateSource, StatePoller, StateUnavailable
from tests.support.loopback import LoopbackServer


def sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"


def plain_app(num_calls: dict) -> Starlette:
    """Any Starlette app: a streaming completions route and nothing kvguard-specific."""

    async def completions(request):
        body = await request.json()
        num_calls["n"] += 1

        async def stream():
            for i in range(body["max_tokens"]):
                yield sse(f"t{i}")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def state_text(request):
        return PlainTextResponse("no state here")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/text/kvguard/state", state_text)])


def test_middleware_on_a_plain_starlette_app_admits_and_streams():
    num_calls = {"n": 0}
    guard = AdmissionMiddleware(plain_app(num_calls), GuardConfig(), registry=CollectorRegistry())

    async def one(client: httpx.AsyncClient, url: str) -> tuple[int, list[bytes], str]:
        body = {"model": "any", "prompt": "hello", "max_tokens": 3, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            chunks = [line async for line in response.aiter_lines() if line]
            return response.status_code, chunks, response.headers.get("x-request-id", "")

    async def main(url: str):
        async with httpx.AsyncClient(timeout=10) as client:
            first = await one(client, url)
            together = await asyncio.gather(*(one(client, url) for _ in range(3)))
        return [first, *together]

    with LoopbackServer(guard) as server:
        results = asyncio.run(main(server.url))
    for status, chunks, request_id in results:
        assert status == 200
        assert chunks == [sse(f"t{i}").decode().strip() for i in range(3)] + ["data: [DONE]"]
        assert uuid.UUID(request_id).version == 4  # what the replica is sent
    assert num_calls["n"] == 4
    replica = guard.controller.load_state.replica_snapshot("local")
    assert replica.healthy and not replica.capacity_known
    assert guard.controller.tickets.num_held == 0 and guard.controller.load_state.num_inflight("local") == 0
    assert guard.controller.registry.get_sample_value(
        "kvguard_requests_completed_total", {"class": "interactive", "tenant": "anonymous"}) == 4


def test_sources_raise_state_unavailable_for_404_and_non_json():
    async def main(url: str):
        app = plain_app({"n": 0})
        with pytest.raises(StateUnavailable, match="404"):
            await AsgiStateSource(app).fetch()
        with pytest.raises(StateUnavailable, match="not JSON"):
            await AsgiStateSource(app, "/text/kvguard/state").fetch()
        async with httpx.AsyncClient() as client:
            with pytest.raises(StateUnavailable, match="404"):
                await HttpStateSource(url, client=client).fetch()
            with pytest.raises(StateUnavailable, match="not JSON"):
                await HttpStateSource(url + "/text", client=client).fetch()

    with LoopbackServer(plain_app({"n": 0})) as server:
        asyncio.run(main(server.url))


def test_poller_registers_unknown_capacity_without_counting_errors():
    async def main():
        load_state = LoadState()
        poller = StatePoller(load_state, {"local": AsgiStateSource(plain_app({"n": 0}))},
                             interval_s=1.0, clock=lambda: 5.0, unhealthy_after_errors=1)
        await poller.refresh_now()
        await poller.refresh_now()
        return load_state, poller

    load_state, poller = asyncio.run(main())
    assert poller.consecutive_errors("local") == 0 and load_state.is_healthy("local")
    replica = load_state.replica_snapshot("local")
    assert (replica.capacity_known, replica.observed_s) == (False, 5.0)
    assert load_state.snapshot(5.0).fresh_replicas() == ()


def test_state_source_none_is_refreshed_in_line_beside_remote_sources():
    """``state_source = "none"`` answers without I/O, so the poller reads it in line (no task,
    no timeout): every round still re-registers it (fresh ``observed_s``), a gated one that
    fails (its replica ejected) still counts errors, and the remote sources refresh as before."""
    from guard.proxy.health import ReplicaHealth
    from guard.replicas.poller import NoStateSource

    class Remote:
        kind = "kvguard"

        async def fetch(self):
            await asyncio.sleep(0)  # a real suspension, as over HTTP
            return {"model": "m", "max_model_len": 4096, "block_size": 16,
                    "num_total_blocks": 100, "num_free_blocks": 60, "max_num_seqs": 8,
                    "max_num_batched_tokens": 2048, "num_preemptions": 0, "step_count": 1,
                    "now_s": 1.0, "running": [], "waiting": [], "iterations": []}

    async def probe(_rid):
        return False

    async def main():
        now = [1.0]
        load_state = LoadState()
        health = ReplicaHealth(["gated"], 1, 60.0, lambda _rid: None, probe, lambda: now[0])
        sources = {"none": NoStateSource(), "gated": health.gate("gated", NoStateSource()),
                   "r1": Remote(), "r2": Remote()}
        poller = StatePoller(load_state, sources, interval_s=1.0, clock=lambda: now[0],
                             unhealthy_after_errors=2)
        await poller.refresh_now()
        health.record_failure("gated")  # ejected: its gate fails every poll
        now[0] = 2.0
        await poller.refresh_now()
        await poller.refresh_now()
        return load_state, poller

    load_state, poller = asyncio.run(main())
    none = load_state.replica_snapshot("none")
    assert (none.capacity_known, none.observed_s) == (False, 2.0) and load_state.is_healthy("none")
    assert poller.consecutive_errors("gated") == 2 and not load_state.is_healthy("gated")
    for rid in ("r1", "r2"):
        snap = load_state.replica_snapshot(rid)
        assert snap.capacity_known and snap.num_total_blocks == 100 and snap.observed_s == 2.0
    assert poller.num_refreshes == 3


@pytest.mark.parametrize("body, parsed", [
    (b'{"kv": {"num_free_blocks": 12}}', {"kv": {"num_free_blocks": 12}}),
    # what Python's JSON writes and orjson refuses: still a state document
    (b'{"ewma": NaN, "ids": [18446744073709551616]}', {"ewma": "nan", "ids": [2 ** 64]}),
])
def test_a_state_document_parses_whatever_python_json_writes(body, parsed):
    from guard.replicas.poller import _state_document

    state = _state_document(body, "test")
    if "ewma" in parsed:
        assert state["ewma"] != state["ewma"] and state["ids"] == parsed["ids"]  # NaN
    else:
        assert state == parsed
    big = _state_document(b'{"ids": [18446744073709551617]}', "test")["ids"][0]
    assert type(big) is int and big == 2 ** 64 + 1  # exact, not orjson's float past 64 bits
    for bad in (b"[1, 2]", b"{not json", b"\xff\xfe"):
        with pytest.raises(StateUnavailable):
            _state_document(bad, "test")
