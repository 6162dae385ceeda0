"""The guard asks each replica's state stream for a phase of its own (``?phase=F``): the
replicas it follows get distinct phases, spread over the interval; a resync asks for the same
phase again; a replica from before the parameter (which ignores it) is read as before. Real
streams over loopback (:func:`serving.state_delta.serve_state_stream`)."""

from __future__ import annotations

import asyncio
import math
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from chaos.state_fleet import _ReplicaApp
from chaos.state_replica import StateReplica
from guard.config import ReplicaConfig
from guard.replicas.auto_source import AutoStateSource
from guard.replicas.poller import state_sources
from guard.replicas.state_stream import StreamStateSource
from serving.state_delta import serve_state_stream, spread_phase, stream_phase
from tests.support.loopback import LoopbackServer


def _phase_asked(url: str) -> float:
    return stream_phase(parse_qs(urlsplit(url).query)["phase"][0])


def _replicas(kind: str, n: int) -> tuple[ReplicaConfig, ...]:
    return tuple(ReplicaConfig(replica_id=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                               state_source=kind) for i in range(n))


def test_the_stream_sources_of_several_replicas_ask_distinct_phases():
    sources = state_sources(_replicas("stream", 16), httpx.AsyncClient(),
                            stream_interval_s=1.0)
    phases = [_phase_asked(source.url) for source in sources.values()]
    # six decimals, rounded down
    assert phases == [math.floor(spread_phase(i) * 1e6) / 1e6 for i in range(16)]
    assert len(set(phases)) == 16 and all(0.0 <= p < 1.0 for p in phases)
    assert [s.phase for s in sources.values()] == [spread_phase(i) for i in range(16)]


def test_auto_sources_hand_their_phase_to_the_stream_they_choose():
    sources = state_sources(_replicas("auto", 4), httpx.AsyncClient())
    assert [s.stream_phase for s in sources.values()] == [spread_phase(i) for i in range(4)]


def test_a_replica_that_joins_later_gets_the_next_phase():
    source, = state_sources(_replicas("stream", 1), httpx.AsyncClient(),
                            first_index=5).values()
    assert source.phase == spread_phase(5)


def test_a_phase_close_to_1_is_asked_below_1():
    source = StreamStateSource("http://r", phase=0.99999999)
    assert _phase_asked(source.url) == 0.999999


@pytest.mark.parametrize("phase", [-0.1, 1.0, float("nan")])
def test_a_bad_phase_is_refused_by_the_source(phase):
    with pytest.raises(ValueError, match="phase"):
        StreamStateSource("http://r", phase=phase)


def test_no_phase_asks_none():
    assert "phase" not in StreamStateSource("http://r").url


def _replica(honours_phase: bool, events_per_stream: int | None = None):
    """An ASGI replica serving the state stream; it records each stream's query. Without
    ``honours_phase`` it drops ``phase`` from the query first (a replica from before the
    parameter read only ``interval_ms``); ``events_per_stream``: each stream ends after that
    many events (the guard then resyncs)."""
    replica = StateReplica(lambda p, d, c: 0.01, num_total_blocks=500, max_num_seqs=8,
                           max_num_batched_tokens=512)
    inner = _ReplicaApp(replica, lambda: 0.0, lambda: None)  # no fleet ticks it
    queries: list[dict] = []

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/kvguard/state/stream":
            query = parse_qs(scope["query_string"].decode())
            queries.append(query)
            if not honours_phase:
                scope = {**scope, "query_string": b"interval_ms=" + query["interval_ms"][0]
                         .encode()}
            sent = [0]

            def serving() -> bool:
                sent[0] += 1
                return events_per_stream is None or sent[0] <= events_per_stream

            return await serve_state_stream(scope, receive, send, inner._compact,
                                            serving=serving)
        await inner(scope, receive, send)

    return app, queries


def test_a_resync_asks_for_the_same_phase_again():
    app, queries = _replica(honours_phase=True, events_per_stream=2)

    async def main(url):
        source = StreamStateSource(url, interval_ms=10, phase=0.37)
        try:
            assert await source.opened(5.0) is None
            for _ in range(1000):  # bounded: until two resyncs (each stream ends after 2)
                # and the third stream's request has reached the replica (the resync is
                # counted before it connects)
                if source.num_resyncs >= 2 and len(queries) >= 3:
                    break
                await asyncio.sleep(0.01)
            return source.num_resyncs
        finally:
            await source.aclose()

    with LoopbackServer(app) as server:
        num_resyncs = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert num_resyncs >= 2 and len(queries) >= 3
    assert all(q["phase"] == ["0.370000"] for q in queries), queries


def test_a_replica_that_ignores_the_phase_is_read_as_before():
    app, queries = _replica(honours_phase=False)

    async def main(url):
        source = StreamStateSource(url, interval_ms=10, phase=0.5)
        try:
            assert await source.opened(5.0) is None
            for _ in range(500):  # bounded: until a few deltas came
                if source.num_events >= 4:
                    break
                await asyncio.sleep(0.01)
            return source.num_events, source.num_resyncs, source.document()
        finally:
            await source.aclose()

    with LoopbackServer(app) as server:
        num_events, num_resyncs, document = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert queries[0]["phase"] == ["0.500000"]  # asked, and ignored
    assert num_events >= 4 and num_resyncs == 0
    assert document is not None and document["num_total_blocks"] == 500


def test_auto_asks_the_replica_for_its_phase():
    app, queries = _replica(honours_phase=True)

    async def main(url):
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            source = AutoStateSource(url, client=client, replica_id="r0", stream_interval_ms=20,
                                     stream_phase=0.25)
            try:
                await source.fetch()
                return source.choice
            finally:
                await source.aclose()

    with LoopbackServer(app) as server:
        choice = asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert choice == "stream" and queries[0]["phase"] == ["0.250000"]


def test_a_replica_that_joins_a_running_proxy_asks_the_next_phase():
    from guard.config import GuardConfig
    from guard.proxy.app import ProxyApp

    def replica(i):
        return {"replica_id": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}",
                "state_source": "stream"}

    async def main():
        proxy = ProxyApp(GuardConfig.from_dict({
            "allow_anonymous": True, "replicas": [replica(0), replica(1)]}))
        try:
            config = GuardConfig.from_dict({"allow_anonymous": True,
                                            "replicas": [replica(0), replica(1), replica(2)]})
            proxy.apply_replicas(config.replicas)
            return {rid: source.phase for rid, source in proxy._sources.items()}
        finally:
            await proxy.aclose()

    phases = asyncio.run(asyncio.wait_for(main(), 30))
    assert phases == {f"r{i}": spread_phase(i) for i in range(3)}
