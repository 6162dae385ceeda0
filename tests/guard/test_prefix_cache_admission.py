"""The guard prices and routes by its prefix-cache view, and isolates tenants' caches with a
per-tenant cache_salt: the controller's flow with the real ``slo`` policy, no ASGI."""

import asyncio
import json

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest
from guard.admission.shedding import Rejection
from guard.admission.wait import Wait
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.replicas.load_state import LoadState
from policies import make_policy
from tests.support.admission import FakeClock, state_doc

TENANTS = {"tenants": ({"name": "alice", "api_key": "sk-alice"},
                       {"name": "bob", "api_key": "sk-bob"})}
SYSTEM = "You answer questions about paged attention and KV caches. " * 60  # ~3,500 chars


def headers(key="sk-alice", **extra):
    return {"authorization": f"Bearer {key}", "content-type": "application/json", **extra}


def body(question, **extra):
    return json.dumps({"model": "tiny", "max_tokens": 16, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **extra}).encode()


def make_controller(**config):
    clock = FakeClock(1.0)
    load_state = LoadState()
    for replica_id in ("a", "b"):
        load_state.update_from_kvguard_state(replica_id, state_doc(max_model_len=4096), clock())
    cfg = GuardConfig.from_dict({**TENANTS, **config})
    return AdmissionController(cfg, registry=CollectorRegistry(), clock=clock,
                               policy=make_policy("slo"), load_state=load_state)


def admit(controller, data, hdrs=None):
    async def go():
        request = AdmissionRequest("/v1/chat/completions", hdrs or headers(), data)
        result = controller.decide(request)
        return await controller.wait(result) if isinstance(result, Wait) else result
    return asyncio.run(asyncio.wait_for(go(), 10))


def finish(admission):
    admission.on_start(200, b"application/json")
    admission.on_body(b'{"usage": {"prompt_tokens": 900, "completion_tokens": 16}}', False)
    admission.finish()


def saturated(doc):
    """Every free block committed to running streams that will grow for a long time."""
    running = [{"request_id": f"x{i}", "num_context_tokens": 160,
                "num_prefill_tokens_remaining": 0, "num_output_tokens": 10, "max_tokens": 2000}
               for i in range(8)]
    return {**doc, "num_free_blocks": 40, "running": running}


def test_a_cached_prefix_is_priced_cheaper_and_routed_to_until_its_replica_saturates():
    controller = make_controller()
    first = admit(controller, body("What is a block table?"))
    assert isinstance(first, Admitted) and first.ticket.cost.cached_prefix_tokens is None
    home = first.replica_id
    other = "b" if home == "a" else "a"
    finish(first)
    second = admit(controller, body("And what is chunked prefill?"))
    cost = second.ticket.cost
    assert set(cost.cached_prefix_tokens) == {home} and cost.cached_prefix_tokens[home] > 600
    assert cost.num_new_blocks_on(home, 16) < cost.num_new_blocks_on(other, 16) == cost.num_blocks
    assert (cost.num_uncached_prompt_tokens_on(home, 16)
            < cost.num_uncached_prompt_tokens_on(other, 16) == cost.num_prompt_tokens)
    assert second.replica_id == home  # affinity, although the other replica is as idle
    # its reservation holds only the new blocks
    assert controller.load_state.num_reserved_blocks(home) == cost.num_new_blocks_on(home, 16)
    finish(second)
    controller.load_state.update_from_kvguard_state(
        home, saturated(state_doc(max_model_len=4096)), controller.clock())
    third = admit(controller, body("Why page the cache?"))
    assert third.ticket.cost.cached_prefix_tokens.get(home, 0) > 600
    assert third.replica_id == other  # the hit no longer outweighs the wait for blocks
    finish(third)
    asyncio.run(controller.aclose())


def test_prefix_cache_off_prices_every_prompt_cold():
    controller = make_controller(prefix_cache="off")
    finish(admit(controller, body("q1")))
    assert admit(controller, body("q2")).ticket.cost.cached_prefix_tokens is None
    asyncio.run(controller.aclose())


def test_tenant_isolation_salts_each_tenant_differently_and_unguessably():
    controller = make_controller(prefix_cache_isolation="tenant",
                                 prefix_cache_secret="s3cret-s3cret-s3cret")
    alice = admit(controller, body("q"))
    bob = admit(controller, body("q"), headers("sk-bob"))
    salt_a = json.loads(alice.body)["cache_salt"]
    salt_b = json.loads(bob.body)["cache_salt"]
    assert salt_a != salt_b and "alice" not in salt_a and len(salt_a) == 32
    # the body forwarded is the one priced, plus the salt: nothing else changed
    sent = json.loads(body("q"))
    assert {k: v for k, v in json.loads(alice.body).items() if k != "cache_salt"} == sent
    # bob resending alice's prompt finds only his own copy in the guard's view, never hers
    assert alice.replica_id != bob.replica_id  # the slo tie-break spread them
    finish(alice)
    finish(bob)
    again = admit(controller, body("q"), headers("sk-bob")).ticket.cost.cached_prefix_tokens
    assert set(again) == {bob.replica_id}
    # a client's own salt cannot reach another tenant's partition: it is folded into its own
    forged = admit(controller, body("q", cache_salt=salt_a), headers("sk-bob"))
    assert json.loads(forged.body)["cache_salt"] not in (salt_a, salt_b)
    # a second guard with the same secret salts alike (guards behind one load balancer)
    twin = make_controller(prefix_cache_isolation="tenant",
                           prefix_cache_secret="s3cret-s3cret-s3cret")
    assert json.loads(admit(twin, body("q")).body)["cache_salt"] == salt_a
    asyncio.run(controller.aclose())
    asyncio.run(twin.aclose())


def test_shared_caches_add_no_salt_and_forward_the_body_as_sent():
    controller = make_controller()
    data = body("q")
    admission = admit(controller, data)
    assert admission.body == data and "cache_salt" not in json.loads(admission.body)
    mine = body("q", cache_salt="my-own-partition")
    assert json.loads(admit(controller, mine).body)["cache_salt"] == "my-own-partition"
    asyncio.run(controller.aclose())


def test_a_cache_salt_that_is_not_a_string_is_a_400():
    for isolation in ("shared", "tenant"):
        controller = make_controller(prefix_cache_isolation=isolation)
        for bad in (7, ["a"], {"x": 1}, ""):
            rejection = admit(controller, body("q", cache_salt=bad))
            assert isinstance(rejection, Rejection) and rejection.status == 400
            assert rejection.param == "cache_salt" and not rejection.should_retry
        assert controller.load_state.num_inflight("a") == controller.load_state.num_inflight("b") == 0
        asyncio.run(controller.aclose())


def test_the_hit_ratio_gauges_are_exported():
    controller = make_controller()
    finish(admit(controller, body("q1")))
    finish(admit(controller, body("q2")))
    values = {s.labels.get("replica"): s.value for m in controller.registry.collect()
              if m.name == "kvguard_prefix_cache_predicted_hit_ratio" for s in m.samples}
    assert len(values) == 1 and 0.3 < next(iter(values.values())) < 0.5  # 2nd of 2 hit ~80 %
    asyncio.run(controller.aclose())
