"""AdmissionController.begin_drain: queued and new requests get 503 shutting_down with retry
advice, the admitted one runs on, wait_drained returns once it ends (no ASGI, fake clock)."""

import asyncio

from guard.admission.admitted import Admitted
from guard.admission.shedding import Rejection
from tests.guard.test_controller import BODY, HEADERS, complete, count, make_controller
from tests.support.admission import SlotPolicy, admit


def test_drain_sheds_queued_and_new_requests_and_waits_for_the_admitted():
    async def main():
        controller = make_controller(policy=SlotPolicy(num_slots=1, queue_s=60.0))
        admitted = await admit(controller, "/v1/completions", HEADERS, BODY)
        assert isinstance(admitted, Admitted)
        queued = asyncio.ensure_future(admit(controller, "/v1/completions", HEADERS, BODY))
        for _ in range(20):  # let it reach the queue
            await asyncio.sleep(0)
        assert len(controller.queue) == 1
        controller.begin_drain()
        shed_queued = await asyncio.wait_for(queued, 10)
        shed_new = await admit(controller, "/v1/completions", HEADERS, BODY)
        drained = asyncio.ensure_future(controller.wait_drained(poll_s=0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not drained.done()  # the admitted request still holds its ticket
        assert complete(admitted)
        await asyncio.wait_for(drained, 10)
        await controller.aclose()
        return shed_queued, shed_new, controller

    shed_queued, shed_new, controller = asyncio.run(main())
    for shed in (shed_queued, shed_new):
        assert isinstance(shed, Rejection)
        assert (shed.status, shed.reason) == (503, "shutting_down")
        assert shed.should_retry and shed.retry_after_s >= 1.0
    assert count(controller, "kvguard_requests_rejected_total", reason="shutting_down") == 2
    assert count(controller, "kvguard_requests_completed_total") == 1
    assert controller.tickets.num_held == 0 and controller.load_state.num_inflight("local") == 0
