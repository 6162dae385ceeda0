"""EndpointPicker: the EPP's director, driven with plain calls (no gRPC, no Envoy) over a real
AdmissionController whose load state the test feeds."""

import asyncio
import json
import uuid

import pytest
from prometheus_client import CollectorRegistry

from guard.admission.shedding import Rejection
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.epp.picker import EndpointPicker, Route, endpoint_of_url
from guard.proxy.health import ReplicaHealth
from guard.replicas.load_state import LoadState
from tests.support.admission import FakeClock, SlotPolicy, state_doc

ENDPOINTS = {"r0": "10.0.0.1:8000", "r1": "10.0.0.2:8000"}
BODY = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 8}).encode()
HEADERS = {":method": "POST", ":path": "/v1/completions?x=1", "content-type": "application/json"}
SSE = (b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
       b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
       b"data: [DONE]\n\n")


class TwoReplicaSlots(SlotPolicy):
    """SlotPolicy over r0 and r1: the least loaded of the healthy replicas (r0 on a tie)."""

    def decide(self, cost, snapshot):
        decision = super().decide(cost, snapshot)
        if not hasattr(decision, "replica_id"):
            return decision
        healthy = [r for r in snapshot.replicas if r.healthy]
        best = min(healthy, key=lambda r: (r.num_inflight, r.replica_id))
        return type(decision)(best.replica_id, predicted_ttft_s=0.1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def make_picker(num_slots: int = 8, queue_s: float | None = 5.0, **config) -> EndpointPicker:
    clock = FakeClock(1.0)
    load_state = LoadState()
    for rid in ENDPOINTS:
        load_state.update_from_kvguard_state(rid, state_doc(), clock())
    controller = AdmissionController(GuardConfig.from_dict(config), registry=CollectorRegistry(),
                                     clock=clock, policy=TwoReplicaSlots(num_slots, queue_s),
                                     load_state=load_state)
    return EndpointPicker(controller, ENDPOINTS)


async def decide(picker, body=BODY, headers=HEADERS, subset=None, gone=None):
    await picker.controller.start()
    exchange = picker.exchange(gone)
    exchange.on_request_headers(headers)
    exchange.add_body(body[:5])
    exchange.add_body(body[5:])
    return exchange, await exchange.decide(subset)


def test_endpoint_of_url_needs_an_ip_address():
    assert endpoint_of_url("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert endpoint_of_url("http://[fd00::1]:8000/") == "[fd00::1]:8000"
    with pytest.raises(ValueError, match="IP address"):
        endpoint_of_url("http://vllm:8000")
    with pytest.raises(ValueError, match="http://IP:PORT"):
        endpoint_of_url("http://10.0.0.5")


def test_an_admitted_request_routes_to_its_replica_and_the_response_feeds_its_ticket():
    async def main():
        picker = make_picker()
        exchange, route = await decide(picker)
        assert isinstance(route, Route) and route.endpoint == ENDPOINTS[route.replica_id]
        assert route.body == BODY and route.content_length is None
        assert uuid.UUID(route.request_id)  # the guard's own id: a UUID
        ticket = exchange.admitted.ticket
        added = dict(exchange.on_response_headers({":status": "200",
                                                   "content-type": "text/event-stream"}))
        assert added["x-kvguard-replica"] == route.replica_id
        assert added["x-request-id"] == route.request_id and "x-kvguard-queue-ms" in added
        for chunk in SSE[:-1]:
            exchange.on_response_body(chunk, False)
        assert ticket.num_content_chunks == 2 and ticket.first_token_s is not None
        exchange.on_response_body(SSE[-1], True)
        assert ticket.outcome == "completed" and ticket.num_output_tokens == 2
        exchange.close(reset=False)
        assert picker.controller.tickets.num_held == 0
        await picker.controller.aclose()
    run(main())


def test_fallbacks_name_the_next_routable_replicas_of_the_subset():
    async def main():
        picker = make_picker()
        picker.num_fallbacks = 1
        exchange, route = await decide(picker)
        other = "r1" if route.replica_id == "r0" else "r0"
        assert route.fallbacks == (ENDPOINTS[other],)
        assert route.destination == f"{route.endpoint},{ENDPOINTS[other]}"
        exchange.close(reset=True)
        exchange, route = await decide(picker, subset=[ENDPOINTS["r1"]])
        assert route.replica_id == "r1" and route.fallbacks == ()  # nothing else allowed
        exchange.close(reset=True)
        picker.controller.load_state.mark_unhealthy("r1", 1.0)
        exchange, route = await decide(picker)
        assert route.replica_id == "r0" and route.fallbacks == ()  # nothing else routable
        exchange.close(reset=True)
        await picker.controller.aclose()
    run(main())


def test_served_by_a_fallback_moves_the_reservation_and_counts_a_failure_of_the_pick():
    async def main():
        picker = make_picker()
        health = ReplicaHealth({rid: f"http://{e}" for rid, e in ENDPOINTS.items()}, 2, 60.0,
                               lambda rid: None, _never, picker.controller.clock)
        picker.health = health
        exchange, route = await decide(picker)
        picked, other = route.replica_id, "r1" if route.replica_id == "r0" else "r0"
        load_state = picker.controller.load_state
        request_id = exchange.admitted.request_id
        assert load_state.reservation(request_id).replica_id == picked
        added = dict(exchange.on_response_headers(
            {":status": "200", "content-type": "text/event-stream",
             "x-envoy-upstream-service-time": "3"}, ENDPOINTS[other]))
        assert load_state.reservation(request_id).replica_id == other
        assert exchange.admitted.replica_id == other and added["x-kvguard-replica"] == other
        assert health.consecutive_failures(picked) == 1  # Envoy could not use the pick
        assert health.consecutive_failures(other) == 0
        for chunk in SSE:
            exchange.on_response_body(chunk, chunk is SSE[-1])
        exchange.close(reset=False)
        assert load_state.reservation(request_id) is None
        assert picker.controller.tickets.num_held == 0
        # served where it was sent, or somewhere this picker does not know: nothing moves
        for served in ("same", "10.9.9.9:1"):
            exchange, route = await decide(picker)
            request_id = exchange.admitted.request_id
            exchange.on_response_headers({":status": "200"},
                                         route.endpoint if served == "same" else served)
            assert load_state.reservation(request_id).replica_id == route.replica_id
            exchange.close(reset=True)
        await picker.controller.aclose()
    run(main())


async def _never(replica_id):
    return False


def test_a_reset_stream_releases_the_ticket_canceled():
    async def main():
        picker = make_picker()
        exchange, _ = await decide(picker)
        ticket = exchange.admitted.ticket
        exchange.on_response_headers({":status": "200", "content-type": "text/event-stream"})
        exchange.on_response_body(SSE[0], False)
        exchange.close(reset=True)
        assert ticket.outcome == "canceled" and picker.controller.tickets.num_held == 0
        exchange.close(reset=True)  # once only
        await picker.controller.aclose()
    run(main())


def test_a_priced_max_tokens_fixes_the_content_length():
    async def main():
        picker = make_picker()
        body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
        exchange, route = await decide(picker, body)
        assert json.loads(route.body)["max_tokens"] > 0
        assert route.content_length == len(route.body) != len(body)
        exchange.close(reset=True)
        await picker.controller.aclose()
    run(main())


def test_the_subset_hint_restricts_the_choice():
    async def main():
        picker = make_picker()
        for _ in range(4):
            exchange, route = await decide(picker, subset=[ENDPOINTS["r1"], "10.9.9.9:1"])
            assert route.replica_id == "r1"
            exchange.close(reset=True)
        exchange, answer = await decide(picker, subset=["10.9.9.9:1"])
        assert isinstance(answer, Rejection) and answer.status == 503
        assert answer.reason == "no_endpoint_in_subset" and exchange.admitted is None
        assert picker.controller.tickets.num_held == 0
        await picker.controller.aclose()
    run(main())


def test_a_shed_is_the_controllers_rejection_and_holds_nothing():
    async def main():
        picker = make_picker(num_slots=0, queue_s=None)
        exchange, answer = await decide(picker)
        assert isinstance(answer, Rejection) and answer.status == 503
        assert exchange.route is None and picker.controller.tickets.num_held == 0
        assert exchange.on_response_headers({":status": "503"}) == []
        await picker.controller.aclose()
    run(main())


def test_a_body_past_the_limit_is_413_whatever_the_path():
    async def main():
        picker = make_picker(max_body_bytes=64)
        exchange = picker.exchange()
        exchange.on_request_headers(HEADERS)
        assert not exchange.add_body(b"x" * 64) and exchange.add_body(b"x")
        answer = await exchange.decide()
        assert isinstance(answer, Rejection) and answer.status == 413
        other = picker.exchange()
        other.on_request_headers({":method": "POST", ":path": "/v1/embeddings"})
        other.add_body(b"x" * 65)
        answer = await other.decide()
        assert isinstance(answer, Rejection) and answer.status == 413
        await picker.controller.aclose()
    run(main())


def test_requests_without_admission_take_turns_over_routable_replicas():
    async def main():
        picker = make_picker()
        await picker.controller.start()
        picked = []
        for _ in range(4):
            exchange = picker.exchange()
            exchange.on_request_headers({":method": "GET", ":path": "/v1/models"})
            route = await exchange.decide()
            picked.append(route.replica_id)
            assert exchange.admitted is None and route.body == b""
        assert sorted(picked) == ["r0", "r0", "r1", "r1"]
        picker.controller.load_state.mark_unhealthy("r0", 2.0)
        exchange = picker.exchange()
        exchange.on_request_headers({":method": "GET", ":path": "/v1/models"})
        assert (await exchange.decide()).replica_id == "r1"
        assert picker.controller.tickets.num_held == 0
        await picker.controller.aclose()
    run(main())


def test_a_client_gone_while_queued_gets_nothing_and_holds_nothing():
    async def main():
        picker = make_picker(num_slots=0)
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(decide(picker, gone=lambda: gone))
        await asyncio.sleep(0.05)
        gone.set_result(None)
        exchange, answer = await task
        assert answer is None and exchange.admitted is None
        assert len(picker.controller.queue) == 0 and picker.controller.tickets.num_held == 0
        await picker.controller.aclose()
    run(main())
