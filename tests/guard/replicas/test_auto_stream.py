"""``state_source = "auto"`` reads a kvguard replica over its state stream when it offers one
(the cheapest source) and polls ``/kvguard/state`` when it does not; the choice and its reason
are logged and shown on the proxy's ``/kvguard/state``. Real state-only replicas over loopback
(:mod:`chaos.state_fleet`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from chaos.state_fleet import StateFleet, StateFleetConfig, _ReplicaApp
from chaos.state_replica import StateReplica
from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from guard.replicas.auto_source import STREAM, AutoStateSource
from guard.replicas.load_state import LoadState
from guard.replicas.poller import HttpStateSource, StatePoller
from guard.replicas.state_stream import StreamStateSource
from tests.support.loopback import LoopbackServer


def _no_stream_app():
    """A kvguard replica that predates the stream: ``/kvguard/state`` but no
    ``/kvguard/state/stream`` (404, as any unknown route)."""
    replica = StateReplica(lambda p, d, c: 0.01, num_total_blocks=500, max_num_seqs=8,
                           max_num_batched_tokens=512)
    inner = _ReplicaApp(replica, lambda: 0.0, lambda: None)  # no fleet ticks it
    asked: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] == "http":
            asked.append(scope["path"])
            if scope["path"] == "/kvguard/state/stream":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"{}"})
                return
        await inner(scope, receive, send)

    return app, asked


def test_auto_reads_a_kvguard_replica_over_its_stream(caplog):
    caplog.set_level(logging.INFO, logger="guard.replicas.auto_source")

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        url = fleet.urls["replica-0"]
        load = LoadState()
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            source = AutoStateSource(url, client=client, replica_id="r0", stream_interval_ms=20)
            poller = StatePoller(load, {"r0": source}, interval_s=60.0)  # rounds by hand
            try:
                await poller.refresh_now()
                assert (source.choice, source.kind) == (STREAM, "kvguard"), source.reason
                assert isinstance(source._source, StreamStateSource)
                stream = source._source
                assert load.replica_snapshot("r0").capacity_known
                for _ in range(100):  # events reach the view between rounds: pushed
                    await asyncio.sleep(0.02)
                    if stream.num_events >= 5:
                        break
                assert stream.num_events >= 5 and poller.num_refreshes == 1
                first_s = load.replica_snapshot("r0").observed_s
                await asyncio.sleep(0.1)
                assert load.replica_snapshot("r0").observed_s > first_s
            finally:
                await poller.stop()
                await fleet.stop()
            assert stream._task is None  # the poller's stop closed the stream
        return source

    source = asyncio.run(asyncio.wait_for(main(), 30))
    assert "/kvguard/state/stream streams its changes" in source.reason
    assert [r.getMessage() for r in caplog.records] == [
        f"replica r0 ({source.url}): state_source auto chose stream: {source.reason}"]


def test_auto_polls_a_kvguard_replica_without_the_stream_route(caplog):
    caplog.set_level(logging.INFO, logger="guard.replicas.auto_source")
    app, asked = _no_stream_app()

    async def main(url):
        load = LoadState()
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            source = AutoStateSource(url, client=client, replica_id="r0")
            poller = StatePoller(load, {"r0": source}, interval_s=60.0)
            try:
                await poller.refresh_now()
                await poller.refresh_now()
                assert isinstance(source._source, HttpStateSource)
            finally:
                await poller.stop()
        return source, load, poller

    with LoopbackServer(app) as server:
        source, load, poller = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert (source.choice, source.kind) == ("kvguard", "kvguard")
    assert "no state stream" in source.reason and "answered 404" in source.reason
    snap = load.replica_snapshot("r0")
    assert snap.capacity_known and snap.num_total_blocks == 500
    assert poller.consecutive_errors("r0") == 0
    # probed once: the stream asked once, /kvguard/state at the probe and at both rounds
    assert asked.count("/kvguard/state/stream") == 1
    assert asked.count("/kvguard/state") == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"replica r0 ({server.url}): state_source auto chose kvguard: {source.reason}"]


def test_the_proxy_shows_which_replica_streams_and_why():
    app, _ = _no_stream_app()

    async def main(polled_url):
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        proxy = ProxyApp(GuardConfig.from_dict({
            "refresh_interval_s": 0.05, "allow_anonymous": True,
            "replicas": [
                {"replica_id": "streamed", "url": fleet.urls["replica-0"],
                 "state_source": "auto"},
                {"replica_id": "polled", "url": polled_url, "state_source": "auto"}]}))
        try:
            await proxy.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy),
                                         base_url="http://proxy") as client:
                for _ in range(100):
                    state = (await client.get("/kvguard/state")).json()
                    rows = {row["replica_id"]: row for row in state["replicas"]}
                    if all(row.get("state_source_chosen") for row in rows.values()):
                        break
                    await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(Exception):
                await proxy.aclose()
            await fleet.stop()
        return rows

    with LoopbackServer(app) as server:
        rows = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert rows["streamed"]["state_source_chosen"] == "stream", rows
    assert "streams its changes" in rows["streamed"]["state_source_reason"]
    assert rows["streamed"]["stream_events"] >= 1 and "stream_events" not in rows["polled"]
    assert rows["polled"]["state_source_chosen"] == "kvguard", rows
    assert "no state stream" in rows["polled"]["state_source_reason"]


def test_a_stream_route_that_goes_away_sends_auto_back_to_polling(caplog):
    """The replica is replaced by one without the stream (its stream ends, a new one is
    answered 404): auto drops the stream and probes again, and polls."""
    from serving.state_delta import serve_state_stream

    caplog.set_level(logging.INFO, logger="guard.replicas.auto_source")
    replica = StateReplica(lambda p, d, c: 0.01, num_total_blocks=500, max_num_seqs=8,
                           max_num_batched_tokens=512)
    inner = _ReplicaApp(replica, lambda: 0.0, lambda: None)  # no fleet ticks it
    offered = [True]

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/kvguard/state/stream":
            if offered[0]:
                return await serve_state_stream(scope, receive, send, inner._compact,
                                                serving=lambda: offered[0])
            await send({"type": "http.response.start", "status": 404, "headers": []})
            return await send({"type": "http.response.body", "body": b"{}"})
        await inner(scope, receive, send)

    async def main(url):
        load = LoadState()
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            source = AutoStateSource(url, client=client, replica_id="r0", stream_interval_ms=20)
            poller = StatePoller(load, {"r0": source}, interval_s=60.0)
            try:
                await poller.refresh_now()
                first = source.choice
                offered[0] = False  # the stream ends; the next one is answered 404
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    await poller.refresh_now()
                    if source.choice == "kvguard":
                        break
                kind = type(source._source)
                await poller.refresh_now()
            finally:
                await poller.stop()
        return first, source, kind, load, poller

    with LoopbackServer(app) as server:
        first, source, kind, load, poller = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert first == STREAM
    assert (source.choice, kind) == ("kvguard", HttpStateSource), source.reason
    assert "no state stream" in source.reason
    assert load.replica_snapshot("r0").capacity_known
    assert poller.consecutive_errors("r0") == 0
    # auto's own lines only: on a loaded machine a round can fall between the stream's end and
    # the new probe, and the poller then warns once that the replica's state was unreadable
    chosen = [r.getMessage().split(": ")[1] for r in caplog.records
              if r.name == "guard.replicas.auto_source"]
    assert chosen == ["state_source auto chose stream", "state_source auto chose kvguard"]
