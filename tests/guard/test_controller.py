"""AdmissionController: the flow without ASGI, and its budget seam (a tiny fake store)."""

import asyncio
import inspect
import json

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admission
from guard.admission.shedding import Rejection
from guard.budget.store import Denied, Grant
from guard.config import GuardConfig, hash_api_key
from guard.controller import AdmissionController, Decided
from guard.replicas.load_state import LoadState
from tests.support.admission import FakeClock, SlotPolicy, state_doc

ACME = {"tenants": ({"name": "acme", "api_key": "sk-acme"},)}
HEADERS = {"authorization": "Bearer sk-acme", "content-type": "application/json"}
BODY = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 8}).encode()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class FakeStore:
    """Records every call; answers reserve with ``answers`` in order (default: grant)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []
        self.renewed = asyncio.Event()
        self.num = 0

    async def reserve(self, tenant, tokens, lease_s):
        self.calls.append(("reserve", tenant, tokens))
        if self.answers:
            return self.answers.pop(0)
        self.num += 1
        return Grant(tenant, f"g{self.num}", tokens)

    async def settle(self, grant, used_tokens):
        self.calls.append(("settle", grant.grant_id, used_tokens))

    async def release(self, grant):
        self.calls.append(("release", grant.grant_id))

    async def renew(self, grants, lease_s):
        self.calls.append(("renew", tuple(g.grant_id for g in grants)))
        self.renewed.set()

    async def aclose(self):
        pass


def make_controller(policy=None, budget=None, **config):
    from guard.config import GuardConfig as _GC

    clock = FakeClock(1.0)
    load_state = LoadState()
    load_state.update_from_kvguard_state("local", state_doc(), clock())
    cfg = _GC.from_dict({**ACME, **config})
    return AdmissionController(cfg, registry=CollectorRegistry(), clock=clock,
                               policy=policy or SlotPolicy(), load_state=load_state,
                               budget=budget)


async def body_of(data=BODY):
    return data


def count(controller, name, **labels):
    labels = {"class": "interactive", "tenant": "acme", **labels}
    return controller.registry.get_sample_value(name, labels) or 0.0


def complete(admission, usage=b'{"usage": {"prompt_tokens": 5, "completion_tokens": 3}}'):
    admission.on_start(200, b"application/json")
    admission.on_body(usage, False)
    return admission.finish()


def test_admit_returns_admission_and_release_settles_grant_with_usage():
    async def main():
        store = FakeStore()
        controller = make_controller(budget=store)
        admission = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        assert isinstance(admission, Admission) and admission.replica_id == "local"
        assert admission.ticket.grant == Grant("acme", "g1", admission.ticket.cost.num_prompt_tokens + 8)
        assert complete(admission) and not admission.finish()  # exactly once
        await controller.aclose()
        assert store.calls[-1] == ("settle", "g1", 8)
        assert count(controller, "kvguard_requests_completed_total") == 1
        assert controller.tickets.num_held == 0 and controller.grants.held == {}
    run(main())


def test_every_other_outcome_releases_the_grant():
    async def main():
        store = FakeStore()
        controller = make_controller(budget=store)
        admission = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        admission.on_start(200, b"text/event-stream")
        admission.on_disconnect()
        admission.finish()
        shed = await make_shed(controller)
        await controller.aclose()
        assert ("release", "g1") in store.calls and ("release", "g2") in store.calls
        assert not any(c[0] == "settle" for c in store.calls)
        assert isinstance(shed, Rejection) and shed.status == 503
        assert count(controller, "kvguard_requests_canceled_total") == 1
    run(main())


async def make_shed(controller):
    controller.policy.num_slots, controller.policy.queue_s = 0, None
    return await controller.admit("/v1/completions", HEADERS, lambda: body_of())


def test_denied_is_429_with_the_store_reason_and_wait_only_when_retryable():
    async def main():
        store = FakeStore(Denied("tpm_limit", 2.5), Denied("tpm_limit", None))
        controller = make_controller(budget=store)
        later = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        never = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        await controller.aclose()
        assert later.status == 429 and later.reason == "tpm_limit"
        assert later.should_retry and later.retry_after_s == 2.5
        assert never.status == 429 and not never.should_retry and never.retry_after_s is None
        headers = dict(never.headers(0))
        assert b"retry-after" not in headers and headers[b"x-should-retry"] == b"false"
        assert count(controller, "kvguard_requests_rejected_total", reason="tpm_limit") == 2
        assert count(controller, "kvguard_requests_admitted_total") == 0
        assert controller.load_state.num_inflight("local") == 0
    run(main())


def test_held_grants_are_renewed_in_the_background():
    async def main():
        store = FakeStore()
        controller = make_controller(budget=store)
        controller.grants.lease_s = 0.03  # renew every 10 ms (a hang guard bounds the wait)
        admission = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        await asyncio.wait_for(store.renewed.wait(), 5)
        assert ("renew", ("g1",)) in store.calls
        complete(admission)
        await controller.aclose()
    run(main())


def test_unknown_key_is_401_and_costs_nothing():
    async def main():
        store = FakeStore()
        controller = make_controller(budget=store, allow_anonymous=False)
        read = []
        rejection = await controller.admit(
            "/v1/completions", {"authorization": "Bearer nope"},
            lambda: read.append(1) or body_of())
        await controller.aclose()
        assert rejection.status == 401 and not rejection.should_retry
        assert read == [] and store.calls == []
    run(main())


def test_defaulted_max_tokens_is_forwarded_as_priced():
    async def main():
        controller = make_controller(SlotPolicy(num_slots=2))
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
        admission = await controller.admit("/api/v1/chat/completions", HEADERS, lambda: body_of(body))
        sent = json.loads(admission.body)
        assert sent["max_tokens"] == admission.ticket.cost.max_tokens == 256 - 8  # fits the context
        assert admission.body_rewritten
        explicit = await controller.admit("/v1/completions", HEADERS, lambda: body_of())
        assert explicit.body == BODY and not explicit.body_rewritten
        for a in (admission, explicit):
            complete(a)
        await controller.aclose()
    run(main())


def test_client_leaving_the_queue_frees_the_grant_and_counts_canceled():
    async def main():
        store = FakeStore()
        controller = make_controller(SlotPolicy(num_slots=0), budget=store)
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(controller.admit("/v1/completions", HEADERS,
                                                      lambda: body_of(), lambda: gone))
        while len(controller.queue) == 0:
            await asyncio.sleep(0)
        gone.set_result({"type": "http.disconnect"})
        assert await task is None
        await controller.aclose()
        assert store.calls[-1] == ("release", "g1")
        assert count(controller, "kvguard_requests_canceled_total") == 1
        assert len(controller.queue) == 0 and controller.tickets.num_held == 0
    run(main())


def test_config_key_hash_is_what_the_controller_matches():
    controller = make_controller()
    assert controller.tenant("Bearer sk-acme").key_sha256 == hash_api_key("sk-acme")
    assert GuardConfig().is_admitted_path("/api/v1/completions")
    assert not GuardConfig().is_admitted_path("/v1/completions/extra")


class FakeShared:
    """A shared-reservations seam: ``confirm`` answers ``answers`` in order (then True) and
    records the reserved blocks of the replica it was asked about."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.version = {"local": 0}
        self.redecided = None
        self.seen = []

    def bind(self, load_state, registry, clock):
        self.load_state = load_state

    async def confirm(self, replica_id, version):
        self.seen.append(self.load_state.num_inflight(replica_id))
        return self.answers.pop(0) if self.answers else True

    async def aclose(self):
        pass


def test_shared_reservations_a_failed_confirm_decides_again_and_counts_one_admission():
    shared = FakeShared(False)
    clock = FakeClock(1.0)
    load_state = LoadState()
    load_state.update_from_kvguard_state("local", state_doc(), clock())
    policy = SlotPolicy(num_slots=2)
    controller = AdmissionController(GuardConfig.from_dict(ACME), registry=CollectorRegistry(),
                                     clock=clock, policy=policy, load_state=load_state,
                                     shared_reservations=shared)

    async def go():
        admission = await controller.admit("/v1/completions", HEADERS, body_of)
        assert isinstance(admission, Admission)
        # decided twice (the reservation taken, dropped, taken again), admitted once
        assert shared.seen == [1, 1] and load_state.num_inflight("local") == 1
        assert policy.admitted_ids == [admission.ticket.cost.request_id]
        assert count(controller, "kvguard_requests_admitted_total") == 1
        assert complete(admission)
        assert load_state.num_inflight("local") == 0
        await controller.aclose()
    run(go())


def test_a_stream_the_client_left_teaches_the_pricer_a_lower_bound():
    """Streams cut short (client gone) are censored endings: after 8 completions of 4 tokens
    and 8 streams left after 6, a request allowed 8 tokens is priced at 4 + 0.5 x 4 = 6.
    Dropping them, as the pricer once did, prices it at 4."""
    controller = make_controller()

    async def go():
        for i in range(16):
            admission = await controller.admit("/v1/completions", HEADERS, body_of)
            if i % 2:
                assert complete(admission, b'{"usage": {"prompt_tokens": 5, '
                                           b'"completion_tokens": 4}}')
                continue
            admission.on_start(200, b"text/event-stream")
            for _ in range(6):
                admission.on_body(b'data: {"choices": [{"text": "x"}]}\n\n', True)
            admission.on_disconnect()
            assert admission.finish()
            assert admission.ticket.outcome == "canceled"
        # each release rebuilt the table with its ending (then due: few endings), so pricing
        # the next request builds nothing
        assert controller.pricer._outputs["interactive"]._stale == 0
        assert controller.pricer.expected_output_tokens("interactive", 8) == 6
        await controller.aclose()
    run(go())


def test_the_slo_policy_learns_client_patience_from_released_tickets_and_exports_it():
    from policies.slo import SloPolicy
    from tests.support.admission import make_cost, reserved

    controller = make_controller(policy=SloPolicy())
    gauge = ("kvguard_client_patience_seconds", {"class": "interactive"})
    assert controller.registry.get_sample_value(*gauge) is None
    for i in range(200):  # every cost below arrived at 0.0
        ticket = controller.tickets.issue(reserved(make_cost(f"r{i}")), 1.0)
        if i % 10 == 0:  # the client left mid-stream, after 6 s
            controller.clock.now_s = 6.0
            ticket.on_start(200, b"text/event-stream")
            ticket.on_disconnect()
            ticket.release(ticket.natural_outcome())
        else:  # the others had their answers after 2 s
            controller.clock.now_s = 2.0
            ticket.release("completed")
    controller.clock.now_s = 6.0
    assert controller.registry.get_sample_value(*gauge) == 6.0
    controller.clock.now_s = 66.0  # held while cancellations stop, up to 60 s after the last
    assert controller.registry.get_sample_value(*gauge) == 6.0
    controller.clock.now_s = 66.5  # then it lapses
    assert controller.registry.get_sample_value(*gauge) is None


def test_the_client_software_of_a_request_reaches_the_policys_completion_sample():
    """Client patience is learned per client software: the User-Agent's first product is on
    the priced cost and on the sample the policy learns from."""
    seen = []

    from policies.always_admit import AlwaysAdmit

    class Recorder(AlwaysAdmit):
        observes_completions = True

        def observe(self, sample):
            seen.append(sample)

    controller = make_controller(policy=Recorder())

    async def go():
        for agent in ("Python/3.12 aiohttp/3.9.5", "OpenAI/Python 1.54.0", None):
            headers = dict(HEADERS) if agent is None else {**HEADERS, "user-agent": agent}
            admission = await controller.admit("/v1/completions", headers, body_of)
            assert complete(admission)
        await controller.aclose()
    run(go())
    assert [s.client for s in seen] == ["python", "openai", ""]


def test_a_newcomer_never_takes_the_seat_a_queued_request_is_waiting_for():
    """Capacity frees up (a state refresh showed a seat) and a newcomer is decided before the
    queue's pump has run: the waiter ahead gets the seat, the newcomer waits behind it. (It
    used to take the seat, and the waiter it passed was shed at its next decision.)"""
    async def main():
        policy = SlotPolicy(num_slots=0)
        controller = make_controller(policy)
        first = asyncio.ensure_future(controller.admit("/v1/completions", HEADERS,
                                                       lambda: body_of()))
        while len(controller.queue) == 0:
            await asyncio.sleep(0)
        (waiter,) = controller.queue.waiters()
        policy.num_slots = 1             # a seat is free now; the pump has not run since
        second = asyncio.ensure_future(controller.admit("/v1/completions", HEADERS,
                                                        lambda: body_of()))
        admission = await first
        assert isinstance(admission, Admission)
        assert policy.admitted_ids == [waiter.cost.request_id]
        await asyncio.sleep(0)
        assert not second.done() and len(controller.queue) == 1  # behind it, still waiting
        complete(admission)
        later = await second             # the seat comes back: now the newcomer's turn
        assert isinstance(later, Admission) and len(policy.admitted_ids) == 2
        complete(later)
        await controller.aclose()
    run(main())


def test_admit_now_answers_at_once_where_the_flow_need_not_wait():
    """``admit_now`` (the proxy on kvguard's server): an Admit, a bad body or an unknown key
    is the result itself, no coroutine; start-up, a budget store's answer and the queue are
    awaitables; the outcomes are counted as ``admit`` counts them."""
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1), allow_anonymous=False)
        first = controller.admit_now("/v1/completions", HEADERS, BODY)
        assert inspect.isawaitable(first)  # before start-up: the whole flow, start-up first
        admission = await first
        assert isinstance(admission, Admission)
        assert complete(admission)
        second = controller.admit_now("/v1/completions", HEADERS, BODY)
        assert isinstance(second, Admission) and second.replica_id == "local"
        assert controller.policy.admitted_ids[-1] == second.request_id  # committed already
        bad = controller.admit_now("/v1/completions", HEADERS, b'{"prompt": ')
        assert isinstance(bad, Rejection) and bad.status == 400
        stranger = controller.admit_now("/v1/completions", {"authorization": "Bearer x"}, BODY)
        assert isinstance(stranger, Rejection) and stranger.status == 401
        controller.policy.queue_s = None  # the one slot is taken: a policy that sheds ...
        shed = controller.admit_now("/v1/completions", HEADERS, BODY)
        assert isinstance(shed, Rejection) and shed.status == 503  # ... sheds at once
        controller.policy.queue_s = 5.0  # ... and one that queues
        third = controller.admit_now("/v1/completions", HEADERS, BODY)
        assert inspect.isawaitable(third)
        waiting = asyncio.ensure_future(third)
        while not len(controller.queue):
            await asyncio.sleep(0)
        assert complete(second)
        admitted = await waiting
        assert isinstance(admitted, Admission) and complete(admitted)
        await controller.aclose()
        assert count(controller, "kvguard_requests_offered_total") == 5  # the 400 too
        assert count(controller, "kvguard_requests_admitted_total") == 3
        assert count(controller, "kvguard_requests_rejected_total", reason="overloaded") == 1
        assert count(controller, "kvguard_requests_completed_total") == 3
        assert controller.tickets.num_held == 0 and len(controller.queue) == 0
    run(main())


def test_admit_now_with_defer_books_and_issues_the_ticket_on_demand():
    """``defer``: an Admit comes back as ``Decided`` (nothing reserved, counted or ticketed
    yet: the proxy writes the request upstream first); ``issue`` books the reservation, counts
    the admit and makes the admission; a write that failed is finished with its error and
    releases everything, as any failed admission."""
    async def main():
        controller = make_controller(SlotPolicy(num_slots=2))
        await controller.start()
        decided = controller.admit_now("/v1/completions", HEADERS, BODY, defer=True)
        assert isinstance(decided, Decided) and decided.replica_id == "local"
        assert controller.load_state.reservation(decided.request_id) is None
        assert controller.tickets.num_held == 0
        assert decided.request_id not in controller.policy.admitted_ids
        assert count(controller, "kvguard_requests_admitted_total") == 0
        assert decided.body == BODY  # as sent: max_tokens was given
        admission = controller.issue(decided)
        assert controller.load_state.reservation(decided.request_id) is not None
        assert controller.policy.admitted_ids[-1] == decided.request_id
        assert count(controller, "kvguard_requests_admitted_total") == 1
        assert isinstance(admission, Admission) and admission.body is decided.body
        assert admission.request_id == decided.request_id and controller.tickets.num_held == 1
        assert complete(admission)
        failed = controller.issue(controller.admit_now("/v1/completions", HEADERS, BODY,
                                                       defer=True))
        assert failed.finish(OSError("the upstream write failed"))
        assert controller.tickets.num_held == 0
        assert controller.load_state.reservation(failed.request_id) is None
        # a shed or a bad body is the same rejection with or without defer
        bad = controller.admit_now("/v1/completions", HEADERS, b'{"prompt": ', defer=True)
        assert isinstance(bad, Rejection) and bad.status == 400
        await controller.aclose()
        assert count(controller, "kvguard_requests_admitted_total") == 2
        assert count(controller, "kvguard_requests_completed_total") == 1
        assert count(controller, "kvguard_requests_failed_total") == 1
    run(main())


def test_a_decided_request_issued_holds_its_capacity_for_the_next_decision():
    """What ``issue`` books is what the next decision sees: with one slot, a second request
    after the first one's ``issue`` is shed, and admitted again once the first completes."""
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1, queue_s=None))
        await controller.start()
        first = controller.issue(controller.admit_now("/v1/completions", HEADERS, BODY,
                                                      defer=True))
        shed = controller.admit_now("/v1/completions", HEADERS, BODY, defer=True)
        assert isinstance(shed, Rejection) and shed.status == 503
        assert complete(first)
        again = controller.admit_now("/v1/completions", HEADERS, BODY, defer=True)
        assert isinstance(again, Decided)
        assert complete(controller.issue(again))
        await controller.aclose()
        assert count(controller, "kvguard_requests_admitted_total") == 2
    run(main())


def test_admit_now_waits_for_a_budget_store_that_cannot_answer_at_once():
    async def main():
        store = FakeStore(Denied("tokens", retry_after_s=2.0))
        controller = make_controller(budget=store)
        await controller.start()
        denied = controller.admit_now("/v1/completions", HEADERS, BODY)
        assert inspect.isawaitable(denied)  # the fake store answers only when awaited
        denied = await denied
        assert isinstance(denied, Rejection) and denied.status == 429
        granted = await controller.admit_now("/v1/completions", HEADERS, BODY)
        assert isinstance(granted, Admission) and granted.ticket.grant.grant_id == "g1"
        assert complete(granted)
        await controller.aclose()
        assert store.calls[-1] == ("settle", "g1", 8)
    run(main())
