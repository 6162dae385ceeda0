"""controller.redispatch: the policy re-decides among the other replicas; the reservation moves."""

import asyncio
import json

from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.replicas.load_state import LoadState
from tests.support.admission import FakeClock, admit, state_doc

BODY = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 8}).encode()


def make_controller():
    clock = FakeClock(1.0)
    load_state = LoadState()
    for replica_id in ("a", "b"):
        load_state.update_from_kvguard_state(replica_id, state_doc(), clock())
    config = GuardConfig.from_dict({"policy": "always_admit"})
    return AdmissionController(config, registry=CollectorRegistry(), clock=clock,
                               load_state=load_state)


def test_redispatch_moves_the_reservation_to_the_policys_choice():
    async def main():
        controller = make_controller()
        admission = await admit(controller, "/v1/completions", {}, BODY)
        first = admission.replica_id
        other = "b" if first == "a" else "a"
        load = controller.load_state
        record = load.reservation(admission.request_id)
        assert admission.ticket.reservation is record  # one in-flight record, not a copy
        assert load.num_inflight(first) == 1 and load.num_inflight(other) == 0
        assert controller.redispatch(admission, [other]) == other
        assert admission.replica_id == other == admission.ticket.replica_id == record.replica_id
        assert load.reservation(admission.request_id) is record  # moved, not re-made
        assert load.num_inflight(first) == 0 and load.num_inflight(other) == 1
        assert load.num_reserved_blocks(first) == 0
        assert load.num_reserved_blocks(other) == admission.ticket.cost.num_blocks
        # nowhere else: the reservation stays with the held ticket until the failure is answered
        assert controller.redispatch(admission, []) is None
        assert load.num_inflight(other) == 1 and admission.replica_id == other
        admission.finish(RuntimeError("upstream failed"))
        assert controller.tickets.num_held == 0
        assert load.num_inflight(first) == 0 and load.num_inflight(other) == 0
        assert load.reservation(admission.request_id) is None
        assert not admission.finish()  # released exactly once
        await controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))


def test_redispatch_on_a_ranked_fleet_stays_among_the_replicas_offered():
    # 40 replicas: the snapshot carries the ranked fleet, which names replicas outside the
    # ones a failed request may move to
    async def main():
        for policy in ("always_admit", "slo"):
            clock = FakeClock(1.0)
            load_state = LoadState()
            for k in range(40):
                load_state.update_from_kvguard_state(f"r{k}", state_doc(), clock())
            assert load_state.snapshot(clock()).fleet is not None
            controller = AdmissionController(
                GuardConfig.from_dict({"policy": policy}), registry=CollectorRegistry(),
                clock=clock, load_state=load_state)
            admission = await admit(controller, "/v1/completions", {}, BODY)
            assert admission.replica_id is not None
            assert controller.redispatch(admission, ["r37"]) == "r37"
            assert load_state.num_inflight("r37") == 1
            admission.finish()
            await controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))
