"""``kvguard epp --replicas-from file:PATH``: the EPP's endpoints follow the list while it
runs — a real EppServer (its gRPC port bound, its poller reading real state-only replicas over
loopback), decided through its picker as the ext_proc stream would."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from chaos.state_fleet import StateFleet, StateFleetConfig
from guard.config import config_with_upstreams
from guard.epp.picker import Route
from guard.epp.server import EppServer

BODY = json.dumps({"model": "llama-7b", "prompt": "hello there", "max_tokens": 8}).encode()
HEADERS = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


async def _decide(server: EppServer):
    exchange = server.picker.exchange()
    exchange.on_request_headers(HEADERS)
    exchange.add_body(BODY)
    route = await exchange.decide(None)
    assert isinstance(route, Route), route
    exchange.on_response_headers({":status": "200", "content-type": "application/json"})
    exchange.on_response_body(b'{"choices": [], "usage": {"completion_tokens": 1}}', True)
    exchange.close(reset=False)
    return route


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def test_the_epp_follows_its_replica_list(tmp_path):
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(2)
        a, b = fleet.urls["replica-0"], fleet.urls["replica-1"]
        listing = tmp_path / "replicas.json"
        listing.write_text(json.dumps([{"replica_id": "a", "url": a}]))
        config = config_with_upstreams(None, [], "kvguard", None, f"file:{listing}")
        config = dataclasses.replace(config, refresh_interval_s=0.05, proxy=dataclasses.replace(
            config.proxy, replicas_from_interval_s=0.05))
        server = EppServer(config)
        await server.start("127.0.0.1", 0)
        picker, load = server.picker, server.controller.load_state
        try:
            assert (await _decide(server)).replica_id == "a"
            listing.write_text(json.dumps([{"replica_id": "a", "url": a},
                                           {"replica_id": "b", "url": b}]))
            await _until(lambda: picker.routable("b"))
            assert picker.endpoints["b"] == b.removeprefix("http://")
            listing.write_text(json.dumps([{"replica_id": "b", "url": b}]))
            await _until(lambda: "a" not in picker.endpoints)  # left, nothing in flight
            assert not load.is_healthy("a") and load.replica_snapshot("a") is None
            assert {(await _decide(server)).replica_id for _ in range(4)} == {"b"}
        finally:
            await server.aclose()
            await fleet.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
