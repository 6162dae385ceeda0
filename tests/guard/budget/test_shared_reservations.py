"""Shared KV reservations through a real redis-server: two guards' load states in one process."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry
from redis_servers import RedisServer, free_port

from guard.replicas.load_state import LoadState
from guard.replicas.shared_reservations import SharedReservations, replica_keys
from tests.support.admission import make_cost, state_doc

URLS = {"r0": "http://127.0.0.1:1/", "r1": "http://127.0.0.1:2/"}


def guard(url: str, urls=URLS) -> tuple[LoadState, SharedReservations, CollectorRegistry]:
    load_state, registry = LoadState(), CollectorRegistry()
    for rid in urls:
        load_state.update_from_kvguard_state(rid, state_doc(num_free_blocks=100), time.monotonic())
    shared = SharedReservations(url, urls, timeout_s=1.0, lease_s=5.0, sync_interval_s=0.05)
    shared.bind(load_state, registry, time.monotonic)
    shared.start()
    return load_state, shared, registry


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def listing(*request_ids: str) -> dict:
    doc = state_doc(num_free_blocks=100)
    doc["running"] = [{"request_id": r, "num_prompt_tokens": 10, "num_output_tokens": 1,
                       "max_tokens": 16, "num_context_tokens": 11,
                       "num_prefill_tokens_remaining": 0, "num_blocks": 1} for r in request_ids]
    return doc


def test_each_guard_subtracts_the_others_pending_reservations_once(redis_server):
    async def go():
        a_state, a, _ = guard(redis_server.url)
        b_state, b, b_registry = guard(redis_server.url)
        await until(lambda: a.shared and b.shared)
        a_state.reserve("r0", "a1", make_cost("a1", num_blocks=7), time.monotonic())
        assert await a.sync("r0")
        await b.sync("r0")
        # b sees a's 7 blocks on r0 (and nothing on r1); a does not count its own twice
        assert b_state.num_reserved_blocks("r0") == 7 and b_state.num_reserved_blocks("r1") == 0
        assert b_state.replica_snapshot("r0").num_inflight == 0  # not b's in-flight
        assert a_state.num_reserved_blocks("r0") == 7
        version = b.version["r0"]
        b_state.reserve("r0", "b1", make_cost("b1", num_blocks=3), time.monotonic())
        assert await b.confirm("r0", version)  # nothing new appeared since b decided
        await a.sync("r0")
        assert a_state.num_reserved_blocks("r0") == 10
        # the replica lists a1: b stops subtracting it (its blocks are in the free count now)
        b_state.update_from_kvguard_state("r0", listing("a1"), time.monotonic())
        assert b_state.num_reserved_blocks("r0") == 3
        await b.sync("r0")
        assert b_state.num_reserved_blocks("r0") == 3  # not added again by the next sync
        # a releases it: withdrawn from Redis
        a_state.release("a1")
        await a.sync("r0")
        entries = redis_server.cli("hkeys", replica_keys(URLS["r0"])[0]).split()
        assert entries == [f"{b.instance}|b1"]
        assert b_registry.get_sample_value("kvguard_kv_reservations_shared") == 1
        await a.aclose()
        await b.aclose()
        assert redis_server.cli("exists", *replica_keys(URLS["r0"])).strip() == "0"
    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_racing_guard_sees_the_earlier_reservation_on_confirm(redis_server):
    async def go():
        a_state, a, _ = guard(redis_server.url)
        b_state, b, _ = guard(redis_server.url)
        await until(lambda: a.shared and b.shared)
        versions = (a.version["r1"], b.version["r1"])
        # both decided on the same view; Redis orders their publications
        a_state.reserve("r1", "a1", make_cost("a1", num_blocks=5), time.monotonic())
        b_state.reserve("r1", "b1", make_cost("b1", num_blocks=5), time.monotonic())
        confirmed = await asyncio.gather(a.confirm("r1", versions[0]), b.confirm("r1", versions[1]))
        assert sorted(confirmed) == [False, True]  # the later one must decide again
        await a.aclose()
        await b.aclose()
    asyncio.run(asyncio.wait_for(go(), 60))


def test_redis_down_local_only_then_republished_when_it_is_back():
    server = RedisServer(port=free_port())

    async def go():
        a_state, a, registry = guard(server.url)
        a_state.reserve("r0", "a1", make_cost("a1", num_blocks=4), time.monotonic())
        assert await a.confirm("r0", 0)  # no Redis: never blocks, local-only
        assert not a.shared and a_state.num_reserved_blocks("r0") == 4
        server.start()
        await until(lambda: a.shared)
        await until(lambda: server.cli("hkeys", replica_keys(URLS["r0"])[0]).split()
                    == [f"{a.instance}|a1"])  # what was pending is published again
        assert registry.get_sample_value("kvguard_kv_reservations_shared") == 1
        server.kill()
        await until(lambda: not a.shared)
        assert registry.get_sample_value("kvguard_kv_reservations_shared") == 0
        await a.aclose()
    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        server.kill()


def test_works_on_a_redis_cluster_one_slot_per_replica(redis_cluster):
    async def go():
        a_state, a, _ = guard(redis_cluster.url)
        b_state, b, _ = guard(redis_cluster.url)
        await until(lambda: a.shared and b.shared)
        a_state.reserve("r0", "a1", make_cost("a1", num_blocks=2), time.monotonic())
        a_state.reserve("r1", "a2", make_cost("a2", num_blocks=3), time.monotonic())
        assert await a.sync("r0") and await a.sync("r1")
        assert await b.sync("r0") and await b.sync("r1")
        assert (b_state.num_reserved_blocks("r0"), b_state.num_reserved_blocks("r1")) == (2, 3)
        await a.aclose()
        await b.aclose()
    asyncio.run(asyncio.wait_for(go(), 60))
