"""The real proxy in front of a replica that shows nothing learns its concurrency limit.

A fake llama.cpp-family server (:mod:`tests.support.fake_llamacpp`) on loopback, ``kvguard
proxy`` as a process with its defaults (``--state-source auto``: the fake has no
``/kvguard/state`` and no ``/metrics``, so the limit is learned), and seeded open-loop chat
streams at a multiple of the server's capacity, the same arrivals bare and guarded. Goodput is
judged at the client: 200, a ``finish_reason`` (an interrupted stream has none), first token
within the class TTFT, every gap within its ITL.
"""

import asyncio
import uuid

import httpx
import pytest
from proxy_helpers import proxy_child, running

from chaos.bench.chat_load import ChatLoad, ChatOutcome, open_loop
from tests.support.fake_llamacpp import FakeLlamaCpp
from tests.support.loopback import LoopbackServer

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-test-key"
TTFT_S, ITL_S = 1.0, 0.5
CONFIG = f"""
policy = "slo"
refresh_interval_s = 0.1
admin_api_key = "{ADMIN_KEY}"
[classes.interactive]
ttft_s = {TTFT_S}
itl_s = {ITL_S}
[policy_params]
stale_max_inflight_per_replica = {{initial_limit}}
[proxy]
read_timeout_s = 30.0
"""


def good(outcome: ChatOutcome) -> bool:
    return outcome.good(TTFT_S, ITL_S)


def chat_load(rate_rps: float, num_requests: int, max_tokens: int, seed: int) -> ChatLoad:
    return ChatLoad(rate_rps, num_requests, max_tokens, seed, model="smollm2-fake",
                    timeout_s=30.0)


async def guarded_run(proxy_url: str, load: ChatLoad
                      ) -> tuple[list[ChatOutcome], list[tuple[int, int]]]:
    """The open loop through the proxy while ``(requests sent, learned limit)`` is sampled
    from its ``/kvguard/state`` every 50 ms."""
    arrived = [0]
    limits: list[tuple[int, int]] = []

    def on_arrival(n: int) -> None:
        arrived[0] = n

    async def sample(client: httpx.AsyncClient) -> None:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        while True:
            state = (await client.get(proxy_url + "/kvguard/state", headers=headers)).json()
            limit = state["replicas"][0]["concurrency_limit"]
            if limit is not None:
                limits.append((arrived[0], limit))
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        sampler = asyncio.create_task(sample(client))
        try:
            outcomes = await open_loop(proxy_url, load, on_arrival)
        finally:
            sampler.cancel()
        state = (await client.get(proxy_url + "/kvguard/state",
                                  headers={"authorization": f"Bearer {ADMIN_KEY}"})).json()
    assert state["replicas"][0]["state_source_chosen"] == "learned", state
    return outcomes, limits


def proxy_for(server_url: str, tmp_path, initial_limit: int):
    config = tmp_path / "proxy.toml"
    config.write_text(CONFIG.format(initial_limit=initial_limit))
    return proxy_child([server_url], str(config), state_source="auto")


def test_single_slot_interrupting_server_settles_at_one_and_beats_bare(tmp_path):
    """At ~4x the server's capacity (a 0.05 s prefill and 16 tokens 30 ms apart: ~0.5 s per
    request) every new stream cuts the running one on the bare server."""
    load = chat_load(8.0, 60, 16, seed=7)
    bare_server = FakeLlamaCpp(num_slots=1, interrupt=True)
    with LoopbackServer(bare_server.app) as server:
        bare = asyncio.run(open_loop(server.url, load))
    fake = FakeLlamaCpp(num_slots=1, interrupt=True)
    with LoopbackServer(fake.app) as server, running(proxy_for(server.url, tmp_path, 4)) as proxy:
        guarded, limits = asyncio.run(guarded_run(proxy.url, load))
    assert fake.bad_request_ids == []  # every id the guard sent parsed as a UUID
    settled = [limit for n, limit in limits if n >= 20]
    assert settled, limits
    assert max(settled) <= 2, limits  # at most a probe of 2
    assert settled.count(1) >= 0.8 * len(settled), limits
    num_good_bare = sum(map(good, bare))
    num_good_guarded = sum(map(good, guarded))
    assert num_good_guarded >= num_good_bare, (num_good_guarded, num_good_bare)
    assert num_good_guarded > 0


def test_four_slot_queueing_server_settles_at_four(tmp_path):
    """llama-server --parallel 4 semantics: a fifth request waits for a slot (TTFT objective
    0.25 s from dispatch, a request holds its slot ~1 s), so the limit that keeps first tokens
    within it is the slot count. Starts at 1: the limit has to grow to it."""
    load = chat_load(8.0, 100, 24, seed=11)
    fake = FakeLlamaCpp(num_slots=4, interrupt=False, prefill_s=0.03, token_s=0.04)
    config = tmp_path / "proxy.toml"
    config.write_text(CONFIG.format(initial_limit=1).replace(f"ttft_s = {TTFT_S}",
                                                              "ttft_s = 0.25"))
    with LoopbackServer(fake.app) as server, \
            running(proxy_child([server.url], str(config), state_source="auto")) as proxy:
        _, limits = asyncio.run(guarded_run(proxy.url, load))
    settled = sorted(limit for n, limit in limits if n >= 40)
    assert settled, limits
    assert 3 <= settled[len(settled) // 2] <= 5, limits  # the median
    assert sum(3 <= x <= 5 for x in settled) >= 0.8 * len(settled), limits


def test_request_ids_sent_upstream_are_uuids(tmp_path):
    fake = FakeLlamaCpp(num_slots=1, interrupt=False, prefill_s=0.0, token_s=0.0)
    with LoopbackServer(fake.app) as server, running(proxy_for(server.url, tmp_path, 4)) as proxy:
        outcome = asyncio.run(open_loop(proxy.url, chat_load(10.0, 1, 3, seed=0)))[0]
        response = httpx.post(proxy.url + "/v1/chat/completions", trust_env=False, timeout=10,
                              json={"model": fake.model, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]})
        metrics = httpx.get(proxy.url + "/metrics", trust_env=False, timeout=10,
                            headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    assert outcome.status == 200 and outcome.finished
    assert fake.bad_request_ids == [] and fake.num_finished == 2
    assert uuid.UUID(response.headers["x-request-id"]).version == 4
    # two requests one at a time: never at the limit, so it stays where it started
    assert 'kvguard_replica_concurrency_limit{replica="r0"} 4.0' in metrics
