"""Two proxies on one real redis-server in front of state-only replicas share the polling
(``proxy.shared_polling_ttl_s``): each replica is polled by exactly one of them, both see every
replica's state, and the shard of a proxy that dies without leaving is taken over within the
TTL. Real parts: redis-server, the replicas over loopback (:mod:`chaos.state_fleet`), the
proxy app and its poller."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from chaos.state_fleet import StateFleet, StateFleetConfig
from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from guard.replicas.shared_polling import PollingShards, SharedStateSource

NUM_REPLICAS = 6
TTL_S = 1.0


def _proxy(redis_url: str, urls: dict[str, str], state_source: str = "kvguard") -> ProxyApp:
    return ProxyApp(GuardConfig.from_dict({
        "refresh_interval_s": 0.05, "allow_anonymous": True, "redis_url": redis_url,
        "proxy": {"shared_polling_ttl_s": TTL_S},
        "replicas": [{"replica_id": rid, "url": url, "state_source": state_source}
                     for rid, url in sorted(urls.items())]}))


def _split(fleet_urls: dict[str, str], *deciders) -> None:
    """Name the deciders so that rendezvous gives each some replicas (random ports and ids
    would leave all six to one in ~3 % of runs)."""
    probe = PollingShards("redis://127.0.0.1:9", ttl_s=1.0)
    token = uuid.uuid4().hex[:8]  # not the id of a decider of an earlier test
    for n in range(100):
        ids = tuple(f"d{i}-{n}-{token}" for i in range(len(deciders)))
        probe.live = ids
        if len({probe.owner(url) for url in fleet_urls.values()}) == len(ids):
            for decider, decider_id in zip(deciders, ids, strict=True):
                decider.shards.decider_id = decider_id
            return
    raise AssertionError("no split found")


def _polls(proxy: ProxyApp) -> dict[str, int]:
    return {rid: src.num_polls for rid, src in proxy._sources.items()}


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.parametrize(("state_source", "redis_kind"), [
    ("kvguard", "redis_server"), ("auto", "redis_server"),
    ("kvguard", "redis_cluster"),  # every key shares the {poll} slot: one node answers all
])
def test_two_proxies_split_the_polling_and_both_see_every_replica(request, state_source,
                                                                  redis_kind):
    redis_url = request.getfixturevalue(redis_kind).url

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.005))
        await fleet.start(NUM_REPLICAS)
        a = _proxy(redis_url, fleet.urls, state_source)
        b = _proxy(redis_url, fleet.urls, state_source)
        _split(fleet.urls, a, b)
        try:
            await a.start()
            await b.start()
            await _until(lambda: len(a.shards.live) == 2 and len(b.shards.live) == 2)
            await asyncio.sleep(3 * 0.05 + TTL_S / 3)  # both lists agree; rounds settle
            before = _polls(a), _polls(b)
            await asyncio.sleep(1.0)
            after = _polls(a), _polls(b)
            owners = {rid: a.shards.owner(url) for rid, url in fleet.urls.items()}
            views = [{rid: p.load_state.replica_snapshot(rid) for rid in fleet.urls}
                     for p in (a, b)]
            rows = {row["replica_id"]: row for row in b.status.state(0)["replicas"]}
        finally:
            await a.aclose()
            await b.aclose()
            await fleet.stop()
        return before, after, owners, views, a.shards.decider_id, b.shards.decider_id, rows

    before, after, owners, views, a_id, b_id, rows = asyncio.run(asyncio.wait_for(main(), 60))
    assert set(owners.values()) == {a_id, b_id}  # six replicas: each proxy owns some
    for rid, owner in owners.items():
        polled_by_a = after[0][rid] - before[0][rid]
        polled_by_b = after[1][rid] - before[1][rid]
        assert (polled_by_a > 0, polled_by_b > 0) == (owner == a_id, owner == b_id), (
            rid, owner, polled_by_a, polled_by_b)
    for view in views:  # both hold every replica's state (read or polled)
        assert all(snap is not None and snap.capacity_known and snap.healthy
                   for snap in view.values()), view
    for rid, owner in owners.items():  # b's /kvguard/state: who polled it, how old it was
        assert rows[rid]["state_polled_by"] == owner
        age_s = rows[rid]["shared_snapshot_age_s"]
        assert age_s is not None and 0 <= age_s <= TTL_S


def test_a_dead_proxys_shard_is_taken_over_within_the_ttl(redis_server):
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.005))
        await fleet.start(NUM_REPLICAS)
        a = _proxy(redis_server.url, fleet.urls)
        b = _proxy(redis_server.url, fleet.urls)
        _split(fleet.urls, a, b)
        try:
            await a.start()
            await b.start()
            await _until(lambda: len(a.shards.live) == 2 and len(b.shards.live) == 2)
            await asyncio.sleep(TTL_S / 2)
            b_shard = {rid for rid, url in fleet.urls.items()
                       if a.shards.owner(url) == b.shards.decider_id}
            assert b_shard and len(b_shard) < NUM_REPLICAS
            # b dies without leaving the list: its heartbeat and its poller just stop
            b.shards._task.cancel()
            await b.controller.aclose()
            died_s = asyncio.get_running_loop().time()
            polls = _polls(a)
            await _until(lambda: all(_polls(a)[rid] > polls[rid] + 2 for rid in b_shard),
                         timeout_s=4 * TTL_S)
            taken_s = asyncio.get_running_loop().time() - died_s
            await _until(lambda: a.shards.live == (a.shards.decider_id,), timeout_s=3 * TTL_S)
            sources = {rid: a._sources[rid] for rid in b_shard}
            rows = {row["replica_id"]: row for row in a.status.state(0)["replicas"]}
            snaps = {rid: a.load_state.replica_snapshot(rid) for rid in fleet.urls}
        finally:
            await a.aclose()
            await b.aclose()
            await fleet.stop()
        return taken_s, sources, snaps, a.shards.decider_id, rows

    taken_s, sources, snaps, a_id, rows = asyncio.run(asyncio.wait_for(main(), 60))
    assert taken_s > 0  # within 4 TTLs (the wait above); docs/benchmarks.md has the times
    assert all(isinstance(s, SharedStateSource) and s.polled_by == a_id
               for s in sources.values())
    assert all(snap is not None and snap.healthy for snap in snaps.values())
    assert all(rows[rid]["state_polled_by"] == a_id for rid in sources)


def test_shared_polling_needs_redis():
    with pytest.raises(ValueError, match="shared_polling_ttl_s: needs redis_url"):
        ProxyApp(GuardConfig.from_dict({
            "proxy": {"shared_polling_ttl_s": 1.0},
            "replicas": [{"replica_id": "r0", "url": "http://127.0.0.1:9"}]}))


@pytest.mark.parametrize("ttl", [0, -1.0, "2"])
def test_a_bad_ttl_is_refused(ttl):
    with pytest.raises(ValueError, match="shared_polling_ttl_s"):
        GuardConfig.from_dict({"proxy": {"shared_polling_ttl_s": ttl},
                               "replicas": [{"replica_id": "r0", "url": "http://h:1"}]})
    with pytest.raises(ValueError, match="shared_polling_ttl_s"):
        PollingShards("redis://127.0.0.1:9", ttl_s=0)


def test_rendezvous_moves_only_the_leavers_share():
    shards = PollingShards("redis://127.0.0.1:9", ttl_s=1.0, decider_id="a")
    urls = [f"http://10.0.0.{i}:8000" for i in range(200)]
    shards.live = ("a", "b", "c")
    three = {url: shards.owner(url) for url in urls}
    assert {three[u] for u in urls} == {"a", "b", "c"}
    shards.live = ("a", "b")
    two = {url: shards.owner(url) for url in urls}
    assert all(two[u] == three[u] for u in urls if three[u] != "c")


def test_without_redis_each_proxy_polls_every_replica():
    """Redis unreachable: the live list is empty and every replica is polled here."""
    from redis_servers import free_port

    from guard.replicas.load_state import LoadState
    from guard.replicas.poller import HttpStateSource, StatePoller

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.005))
        await fleet.start(2)
        shards = PollingShards(f"redis://127.0.0.1:{free_port()}/0", ttl_s=1.0, timeout_s=0.2)
        load = LoadState()
        import httpx
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            sources = {rid: SharedStateSource(HttpStateSource(url, client=client), url, shards)
                       for rid, url in fleet.urls.items()}
            poller = StatePoller(load, sources, interval_s=60.0)
            try:
                assert await shards.heartbeat() == ()
                await poller.refresh_now()
            finally:
                await poller.stop()
                await shards.stop()
                await fleet.stop()
        return sources, load, shards

    sources, load, shards = asyncio.run(asyncio.wait_for(main(), 30))
    assert all(s.num_polls == 1 and s.polled_by == shards.decider_id for s in sources.values())
    assert all(load.replica_snapshot(rid).capacity_known for rid in sources)


def test_a_proxy_and_an_epp_share_the_polling(redis_server):
    """``kvguard epp`` reads the same ``[proxy]`` table: an EPP and a proxy split the fleet."""
    from guard.epp.server import EppServer

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.005))
        await fleet.start(NUM_REPLICAS)
        proxy = _proxy(redis_server.url, fleet.urls)
        epp = EppServer(GuardConfig.from_dict({
            "refresh_interval_s": 0.05, "allow_anonymous": True,
            "redis_url": redis_server.url, "proxy": {"shared_polling_ttl_s": TTL_S},
            "replicas": [{"replica_id": rid, "url": url, "state_source": "kvguard"}
                         for rid, url in sorted(fleet.urls.items())]}))
        _split(fleet.urls, proxy, epp)
        try:
            await proxy.start()
            await epp.start("127.0.0.1", 0)
            await _until(lambda: len(proxy.shards.live) == 2 and len(epp.shards.live) == 2)
            await asyncio.sleep(3 * 0.05 + TTL_S / 3)
            def polls():
                return _polls(proxy), {rid: s.num_polls for rid, s in epp.sources.items()}

            before = polls()
            await asyncio.sleep(1.0)
            after = polls()
            owners = {rid: proxy.shards.owner(url) for rid, url in fleet.urls.items()}
            snaps = {rid: epp.controller.load_state.replica_snapshot(rid) for rid in fleet.urls}
        finally:
            await proxy.aclose()
            await epp.aclose()
            await fleet.stop()
        return before, after, owners, snaps, proxy.shards.decider_id

    before, after, owners, snaps, proxy_id = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(set(owners.values())) == 2
    for rid, owner in owners.items():
        by_proxy, by_epp = (after[i][rid] > before[i][rid] for i in (0, 1))
        assert (by_proxy, by_epp) == (owner == proxy_id, owner != proxy_id), (rid, owner)
    assert all(snap is not None and snap.capacity_known for snap in snaps.values())
