"""AdmissionController: the flow without ASGI, and its budget seam (a tiny fake store)."""

import asyncio
import json

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest, read_request
from guard.admission.shedding import Rejection
from guard.admission.wait import BUDGET, CLIENT_LEFT, QUEUE, STARTING, Wait
from guard.budget.store import Denied, Grant
from guard.config import GuardConfig, hash_api_key
from guard.controller import AdmissionController
from guard.errors import BodyTooLarge, ClientDisconnected
from guard.replicas.load_state import LoadState
from tests.support.admission import FakeClock, SlotPolicy, admit, state_doc

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
        admission = await admit(controller, "/v1/completions", HEADERS, BODY)
        assert isinstance(admission, Admitted) and admission.replica_id == "local"
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
        admission = await admit(controller, "/v1/completions", HEADERS, BODY)
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
    return await admit(controller, "/v1/completions", HEADERS, BODY)


def test_denied_is_429_with_the_store_reason_and_wait_only_when_retryable():
    async def main():
        store = FakeStore(Denied("tpm_limit", 2.5), Denied("tpm_limit", None))
        controller = make_controller(budget=store)
        later = await admit(controller, "/v1/completions", HEADERS, BODY)
        never = await admit(controller, "/v1/completions", HEADERS, BODY)
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
        admission = await admit(controller, "/v1/completions", HEADERS, BODY)
        await asyncio.wait_for(store.renewed.wait(), 5)
        assert ("renew", ("g1",)) in store.calls
        complete(admission)
        await controller.aclose()
    run(main())


def test_unknown_key_is_401_and_costs_nothing():
    """The tenant is checked before anything else: an unknown key is a 401 even when its
    body could not be read (too large), and it reaches no budget store."""
    async def main():
        store = FakeStore()
        controller = make_controller(budget=store, allow_anonymous=False)
        await controller.start()
        stranger = {"authorization": "Bearer nope"}
        rejection = controller.decide(AdmissionRequest("/v1/completions", stranger, BODY))
        too_large = controller.decide(AdmissionRequest("/v1/completions", stranger, b"",
                                                       unread=BodyTooLarge(10)))
        await controller.aclose()
        for answer in (rejection, too_large):
            assert isinstance(answer, Rejection)
            assert answer.status == 401 and not answer.should_retry
        assert store.calls == []
        assert count(controller, "kvguard_requests_rejected_total", reason="invalid_api_key",
                     tenant="unknown") == 2
    run(main())


def test_defaulted_max_tokens_is_forwarded_as_priced():
    async def main():
        controller = make_controller(SlotPolicy(num_slots=2))
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
        admission = await admit(controller, "/api/v1/chat/completions", HEADERS, body)
        sent = json.loads(admission.body)
        assert sent["max_tokens"] == admission.ticket.cost.max_tokens == 256 - 8  # fits the context
        assert admission.body_rewritten
        explicit = await admit(controller, "/v1/completions", HEADERS, BODY)
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
        task = asyncio.ensure_future(admit(controller, "/v1/completions", HEADERS, BODY,
                                           lambda: gone))
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
        admission = await admit(controller, "/v1/completions", HEADERS, BODY)
        assert isinstance(admission, Admitted)
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
            admission = await admit(controller, "/v1/completions", HEADERS, BODY)
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
            admission = await admit(controller, "/v1/completions", headers, BODY)
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
        first = asyncio.ensure_future(admit(controller, "/v1/completions", HEADERS, BODY))
        while len(controller.queue) == 0:
            await asyncio.sleep(0)
        (waiter,) = controller.queue.waiters()
        policy.num_slots = 1             # a seat is free now; the pump has not run since
        second = asyncio.ensure_future(admit(controller, "/v1/completions", HEADERS, BODY))
        admission = await first
        assert isinstance(admission, Admitted)
        assert policy.admitted_ids == [waiter.cost.request_id]
        await asyncio.sleep(0)
        assert not second.done() and len(controller.queue) == 1  # behind it, still waiting
        complete(admission)
        later = await second             # the seat comes back: now the newcomer's turn
        assert isinstance(later, Admitted) and len(policy.admitted_ids) == 2
        complete(later)
        await controller.aclose()
    run(main())


# --- the two calls: decide(request) -> Admitted | Rejection | Wait; await wait(waiting) ------

def request_of(body=BODY, headers=HEADERS, client_gone=None, path="/v1/completions"):
    return AdmissionRequest(path, headers, body, client_gone)


class InstantStore(FakeStore):
    """A store that answers at once (as the memory store does): no Wait for the budget."""

    def reserve_now(self, tenant, tokens, lease_s):
        self.calls.append(("reserve_now", tenant, tokens))
        if self.answers:
            return self.answers.pop(0)
        self.num += 1
        return Grant(tenant, f"g{self.num}", tokens)


def test_decide_admits_at_once_with_its_reservation_and_ticket_booked():
    """An admit comes back booked: the reservation, the admit counted, the ticket held, so the
    very next decision sees it (one slot: the next request is shed); a write that failed is
    finished with its error and releases everything."""
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1, queue_s=None))
        await controller.start()
        admitted = controller.decide(request_of())
        assert isinstance(admitted, Admitted) and admitted.replica_id == "local"
        assert controller.load_state.reservation(admitted.request_id) is not None
        assert controller.tickets.num_held == 1
        assert controller.policy.admitted_ids == [admitted.request_id]
        assert count(controller, "kvguard_requests_admitted_total") == 1
        assert admitted.body is BODY and not admitted.body_rewritten  # as sent
        shed = controller.decide(request_of())  # the one slot is taken
        assert isinstance(shed, Rejection) and (shed.status, shed.reason) == (503, "overloaded")
        assert admitted.finish(OSError("the upstream write failed"))
        assert controller.tickets.num_held == 0
        assert controller.load_state.reservation(admitted.request_id) is None
        again = controller.decide(request_of())  # the slot is back
        assert isinstance(again, Admitted) and complete(again)
        await controller.aclose()
        assert count(controller, "kvguard_requests_offered_total") == 3
        assert count(controller, "kvguard_requests_admitted_total") == 2
        assert count(controller, "kvguard_requests_rejected_total", reason="overloaded") == 1
        assert count(controller, "kvguard_requests_failed_total") == 1
        assert count(controller, "kvguard_requests_completed_total") == 1
    run(main())


def test_decide_before_start_up_waits_for_it_and_a_wait_is_waited_for_once():
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1))
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == STARTING
        assert controller.tickets.num_held == 0  # nothing decided yet
        admitted = await controller.wait(waiting)
        assert isinstance(admitted, Admitted) and complete(admitted)
        try:
            await controller.wait(waiting)
        except RuntimeError as error:
            assert "waited for already" in str(error)
        else:
            raise AssertionError("a Wait was waited for twice")
        await controller.aclose()
        assert count(controller, "kvguard_requests_admitted_total") == 1
    run(main())


def test_decide_rejects_bad_input_and_unread_bodies_at_once():
    """Bad JSON (400), a body over the limit (413) and a client that left while sending its
    body (a Wait that ends in None, counted canceled) are decided without the policy."""
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1))
        await controller.start()
        bad = controller.decide(request_of(b'{"prompt": '))
        assert isinstance(bad, Rejection) and bad.status == 400 and not bad.should_retry
        too_large = controller.decide(AdmissionRequest("/v1/completions", HEADERS, b"",
                                                       unread=BodyTooLarge(10)))
        assert isinstance(too_large, Rejection) and too_large.status == 413
        left = controller.decide(AdmissionRequest("/v1/completions", HEADERS, b"",
                                                  unread=ClientDisconnected()))
        assert isinstance(left, Wait) and left.stage == CLIENT_LEFT
        assert await controller.wait(left) is None
        await controller.aclose()
        assert controller.policy.admitted_ids == [] and controller.tickets.num_held == 0
        assert count(controller, "kvguard_requests_canceled_total") == 1
        assert count(controller, "kvguard_requests_rejected_total", reason="body_too_large") == 1
        assert count(controller, "kvguard_requests_offered_total") == 3
    run(main())


def test_read_request_carries_the_body_or_what_stopped_it():
    async def main():
        async def too_large():
            raise BodyTooLarge(10)

        async def gone():
            raise ClientDisconnected()

        whole = await read_request("/v1/completions", HEADERS, lambda: BODY)
        assert whole.body == BODY and whole.unread is None and whole.api_key == "sk-acme"
        awaited = await read_request("/v1/completions", {}, body_of)
        assert awaited.body == BODY and awaited.api_key is None
        assert isinstance((await read_request("/", {}, too_large)).unread, BodyTooLarge)
        assert isinstance((await read_request("/", {}, gone)).unread, ClientDisconnected)

    async def body_of():
        return BODY
    run(main())


def test_queued_then_admitted_once_capacity_frees():
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1, queue_s=5.0))
        await controller.start()
        first = controller.decide(request_of())
        assert isinstance(first, Admitted)
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == QUEUE
        task = asyncio.ensure_future(controller.wait(waiting))
        while not len(controller.queue):
            await asyncio.sleep(0)
        assert not task.done() and controller.tickets.num_held == 1
        assert complete(first)  # the release wakes the queue's pump
        second = await task
        assert isinstance(second, Admitted) and second.ticket.enqueue_s is not None
        assert complete(second)
        await controller.aclose()
        assert count(controller, "kvguard_requests_queued_total") == 1
        assert count(controller, "kvguard_requests_admitted_total") == 2
        assert controller.tickets.num_held == 0 and len(controller.queue) == 0
    run(main())


def test_queued_then_shed_when_its_wait_runs_out():
    async def main():
        store = InstantStore()
        controller = make_controller(SlotPolicy(num_slots=1, queue_s=5.0), budget=store)
        await controller.start()
        first = controller.decide(request_of())
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == QUEUE
        task = asyncio.ensure_future(controller.wait(waiting))
        while not len(controller.queue):
            await asyncio.sleep(0)
        controller.clock.advance(6.0)  # past its queue deadline
        controller.queue.wake()
        shed = await task
        assert isinstance(shed, Rejection) and (shed.status, shed.reason) == (503, "queue_timeout")
        assert ("release", "g2") in store.calls  # the queued request's grant is given back
        assert complete(first)
        await controller.aclose()
        assert count(controller, "kvguard_requests_rejected_total", reason="queue_timeout") == 1
        assert count(controller, "kvguard_requests_admitted_total") == 1
        assert controller.tickets.num_held == 0 and controller.grants.held == {}
    run(main())


def test_queued_then_the_client_leaves():
    async def main():
        store = InstantStore()
        controller = make_controller(SlotPolicy(num_slots=0), budget=store)
        await controller.start()
        gone = asyncio.get_running_loop().create_future()
        waiting = controller.decide(request_of(client_gone=lambda: gone))
        assert isinstance(waiting, Wait) and waiting.stage == QUEUE
        task = asyncio.ensure_future(controller.wait(waiting))
        while not len(controller.queue):
            await asyncio.sleep(0)
        gone.set_result({"type": "http.disconnect"})
        assert await task is None
        await controller.aclose()
        assert store.calls[-1] == ("release", "g1")
        assert count(controller, "kvguard_requests_canceled_total") == 1
        assert len(controller.queue) == 0 and controller.tickets.num_held == 0
        assert controller.load_state.num_inflight("local") == 0
    run(main())


def test_a_budget_store_that_answers_at_once_denies_or_grants_within_decide():
    async def main():
        store = InstantStore(Denied("tpm_limit", 2.0))
        controller = make_controller(budget=store)
        await controller.start()
        denied = controller.decide(request_of())
        assert isinstance(denied, Rejection) and denied.status == 429
        assert denied.reason == "tpm_limit" and denied.retry_after_s == 2.0
        granted = controller.decide(request_of())
        assert isinstance(granted, Admitted) and granted.ticket.grant.grant_id == "g1"
        assert complete(granted)
        await controller.aclose()
        assert store.calls[-1] == ("settle", "g1", 8)
        assert count(controller, "kvguard_requests_admitted_total") == 1
    run(main())


def test_a_slow_budget_store_is_a_wait_for_its_answer():
    async def main():
        store = FakeStore(Denied("tokens", retry_after_s=2.0))  # answers only when awaited
        controller = make_controller(budget=store)
        await controller.start()
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == BUDGET
        assert store.calls == []  # asked only once the adapter waits
        denied = await controller.wait(waiting)
        assert isinstance(denied, Rejection) and denied.status == 429
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == BUDGET
        granted = await controller.wait(waiting)
        assert isinstance(granted, Admitted) and granted.ticket.grant.grant_id == "g1"
        assert complete(granted)
        await controller.aclose()
        assert store.calls[-1] == ("settle", "g1", 8)
    run(main())


def test_while_draining_decide_sheds_shutting_down_and_a_queued_wait_ends_shed():
    async def main():
        controller = make_controller(SlotPolicy(num_slots=1, queue_s=60.0))
        await controller.start()
        admitted = controller.decide(request_of())
        waiting = controller.decide(request_of())
        assert isinstance(waiting, Wait) and waiting.stage == QUEUE
        task = asyncio.ensure_future(controller.wait(waiting))
        while not len(controller.queue):
            await asyncio.sleep(0)
        controller.begin_drain()
        queued = await task
        new = controller.decide(request_of())
        for shed in (queued, new):
            assert isinstance(shed, Rejection)
            assert (shed.status, shed.reason) == (503, "shutting_down") and shed.should_retry
        assert controller.tickets.num_held == 1  # the admitted one runs on
        assert complete(admitted)
        await asyncio.wait_for(controller.wait_drained(poll_s=0), 10)
        await controller.aclose()
        assert count(controller, "kvguard_requests_rejected_total", reason="shutting_down") == 2
    run(main())
