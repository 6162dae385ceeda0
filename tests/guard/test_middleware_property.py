"""Whatever mix of completions, disconnects, errors and cancellations: nothing leaks."""

import asyncio
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.admission import PROMPT, Client, SlotPolicy, http_scope, make_guard

BEHAVIOURS = ("complete", "disconnect", "error", "leave_early", "cancel")


class ListeningApp:
    """Streams chunks while listening for http.disconnect (as Starlette's StreamingResponse)."""

    def __init__(self, plans):
        self.plans = plans  # request_id -> (behaviour, num_chunks)

    async def __call__(self, scope, receive, send):
        await receive()
        rid = dict(scope["headers"])[b"x-request-id"].decode()
        behaviour, num_chunks = self.plans.pop(0)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        stream = asyncio.ensure_future(self._stream(send, behaviour, num_chunks, rid))
        listen = asyncio.ensure_future(self._listen(receive))
        done, pending = await asyncio.wait((stream, listen), return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if stream in done:
            stream.result()  # re-raise the app's error

    async def _stream(self, send, behaviour, num_chunks, rid):
        for i in range(num_chunks):
            if behaviour == "error" and i == num_chunks - 1:
                raise RuntimeError("boom")
            await send({"type": "http.response.body", "body": b'data: {"text":"x"}\n\n', "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _listen(self, receive):
        while (await receive())["type"] != "http.disconnect":
            pass


async def one_request(guard, behaviour, num_chunks):
    client = Client(PROMPT)
    if behaviour == "leave_early":
        client.disconnect()
    elif behaviour == "disconnect":
        client.on_send = lambda m: client.disconnect() if m.get("more_body") else None
    task = asyncio.ensure_future(guard(http_scope(), client.receive, client.send))
    if behaviour == "cancel":
        for _ in range(num_chunks):
            await asyncio.sleep(0)
        task.cancel()
    try:
        await task
    except (RuntimeError, asyncio.CancelledError):
        pass
    return client


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.sampled_from(BEHAVIOURS), st.integers(1, 4)), min_size=1, max_size=8),
       num_slots=st.integers(0, 3), queue=st.booleans(), max_queue_len=st.integers(1, 4))
def test_random_disconnects_and_errors_leave_nothing_held(requests, num_slots, queue, max_queue_len):
    async def main():
        app = ListeningApp([])
        policy = SlotPolicy(num_slots=num_slots, queue_s=0.05 if queue else None)
        guard = make_guard(app, policy=policy, clock=time.monotonic, max_queue_len=max_queue_len)
        # the app pops plans in dispatch order; every plan is keyed by admission order
        app.plans.extend(requests * 2)
        await asyncio.wait_for(
            asyncio.gather(*(one_request(guard, b, n) for b, n in requests)), 5)
        assert guard.controller.tickets.num_held == 0
        assert guard.controller.load_state.num_reserved_blocks("local") == 0
        assert guard.controller.load_state.num_inflight("local") == 0
        assert len(guard.controller.queue) == 0
        reg = guard.controller.registry
        lab = {"class": "interactive", "tenant": "anonymous"}
        offered = reg.get_sample_value("kvguard_requests_offered_total", lab) or 0
        ended = sum(reg.get_sample_value(f"kvguard_requests_{o}_total", lab) or 0
                    for o in ("completed", "canceled", "failed"))
        rejected = sum(s.value for m in reg.collect() if m.name == "kvguard_requests_rejected"
                       for s in m.samples if s.name.endswith("_total"))
        assert offered == len(requests) == ended + rejected
        assert len(policy.samples) == len(policy.admitted_ids)
        await guard.aclose()
    asyncio.run(main())
