"""AdmissionMiddleware over a tiny ASGI app, driven by hand (no server, no sleeps to wait on)."""

import asyncio
import json

import pytest

from guard.config import hash_api_key
from tests.support.admission import PROMPT, Client, FakeClock, SlotPolicy, http_scope, make_guard


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"


class StreamApp:
    """Streams ``tokens`` as SSE; waits on ``gate`` between chunks when given; records what it saw."""

    def __init__(self, tokens=("a", "b", "c"), gate=None, fail_after=None, listen=False):
        self.tokens, self.gate, self.fail_after, self.listen = tokens, gate, fail_after, listen
        self.seen_headers = None
        self.saw_disconnect = False
        self.num_calls = 0

    async def __call__(self, scope, receive, send):
        self.num_calls += 1
        self.seen_headers = dict(scope["headers"])
        message = await receive()
        assert message["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i, token in enumerate(self.tokens):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("engine blew up")
            if self.gate is not None:
                await self.gate.get()
            if self.listen and i > 0:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.saw_disconnect = True
                    return
            await send({"type": "http.response.body", "body": sse(token), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def assert_at_rest(guard):
    assert guard.controller.tickets.num_held == 0
    assert guard.controller.load_state.num_reserved_blocks("local") == 0
    assert guard.controller.load_state.num_inflight("local") == 0
    assert len(guard.controller.queue) == 0


def sample(guard, name, **labels):
    return guard.controller.registry.get_sample_value(name, labels) or 0.0


def test_stream_passes_through_unbuffered_with_guard_headers():
    async def main():
        gate = asyncio.Queue()
        app = StreamApp(gate=gate)
        guard = make_guard(app)
        client = Client(PROMPT)
        # the app may produce the next chunk only after the previous one reached the client
        client.on_send = lambda m: gate.put_nowait(1) if m["type"] == "http.response.start" or m.get("more_body") else None
        await guard(http_scope(), client.receive, client.send)
        bodies = [m["body"] for m in client.sent[1:]]
        assert bodies == [sse("a"), sse("b"), sse("c"), b"data: [DONE]\n\n"]
        assert client.status == 200 and "x-kvguard-queue-ms" in client.headers
        rid = app.seen_headers[b"x-request-id"].decode()
        assert client.headers["x-request-id"] == rid
        assert guard.controller.policy.samples[0].request_id == rid and guard.controller.policy.samples[0].ok
        assert_at_rest(guard)
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_completed_total", **lab) == 1
        assert sample(guard, "kvguard_goodput_total", **lab) == 1
        await guard.aclose()
    run(main())


def test_disconnect_mid_stream_cancels_upstream_and_releases_once():
    async def main():
        app = StreamApp(listen=True)
        guard = make_guard(app)
        client = Client(PROMPT)
        client.on_send = lambda m: client.disconnect() if m.get("body") == sse("a") else None
        await guard(http_scope(), client.receive, client.send)
        assert app.saw_disconnect
        assert [s.ok for s in guard.controller.policy.samples] == [False]
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_canceled_total", **lab) == 1
        assert sample(guard, "kvguard_requests_completed_total", **lab) == 0
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_exception_releases_once_and_reraises():
    async def main():
        guard = make_guard(StreamApp(fail_after=1))
        client = Client(PROMPT)
        with pytest.raises(RuntimeError, match="blew up"):
            await guard(http_scope(), client.receive, client.send)
        assert len(guard.controller.policy.samples) == 1
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_failed_total", **lab) == 1
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_cancelled_task_releases_as_canceled():
    async def main():
        gate = asyncio.Queue()  # never opened: the app hangs after the response start
        guard = make_guard(StreamApp(gate=gate))
        client = Client(PROMPT)
        task = asyncio.ensure_future(guard(http_scope(), client.receive, client.send))
        while not client.sent:
            await asyncio.sleep(0)
        assert guard.controller.tickets.num_held == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sample(guard, "kvguard_requests_canceled_total", **{"class": "interactive", "tenant": "anonymous"}) == 1
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_queued_request_is_admitted_when_capacity_frees():
    async def main():
        gate = asyncio.Queue()
        app = StreamApp(tokens=("a",), gate=gate)
        clock = FakeClock(1.0)
        guard = make_guard(app, policy=SlotPolicy(num_slots=1), clock=clock)
        first, second = Client(PROMPT), Client(PROMPT)
        t1 = asyncio.ensure_future(guard(http_scope(), first.receive, first.send))
        while not first.sent:
            await asyncio.sleep(0)
        t2 = asyncio.ensure_future(guard(http_scope(), second.receive, second.send))
        while len(guard.controller.queue) == 0:
            await asyncio.sleep(0)
        assert app.num_calls == 1  # the second waits in the guard, not in the app
        clock.advance(0.25)
        gate.put_nowait(1)  # the first finishes; its release wakes the queue
        await t1
        gate.put_nowait(1)
        await t2
        assert second.status == 200 and second.body.endswith(b"data: [DONE]\n\n")
        assert float(second.headers["x-kvguard-queue-ms"]) == pytest.approx(250.0)
        assert sample(guard, "kvguard_requests_queued_total", **{"class": "interactive", "tenant": "anonymous"}) == 1
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_disconnect_while_queued_is_canceled_and_never_reaches_the_app():
    async def main():
        gate = asyncio.Queue()
        app = StreamApp(tokens=("a",), gate=gate)
        guard = make_guard(app, policy=SlotPolicy(num_slots=1))
        first, second = Client(PROMPT), Client(PROMPT)
        t1 = asyncio.ensure_future(guard(http_scope(), first.receive, first.send))
        while not first.sent:
            await asyncio.sleep(0)
        t2 = asyncio.ensure_future(guard(http_scope(), second.receive, second.send))
        while len(guard.controller.queue) == 0:
            await asyncio.sleep(0)
        second.disconnect()
        await t2
        assert second.sent == [] and len(guard.controller.queue) == 0 and app.num_calls == 1
        gate.put_nowait(1)
        await t1
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_canceled_total", **lab) == 1
        assert sample(guard, "kvguard_requests_offered_total", **lab) == 2
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_a_client_that_leaves_while_sending_its_body_is_canceled_and_gets_nothing():
    """The body's first part arrives, then the client leaves: nothing is sent, the app never
    runs, and the request is counted offered and canceled (never admitted)."""
    async def main():
        app = StreamApp()
        guard = make_guard(app, policy=SlotPolicy(num_slots=1))
        client = Client(b"")
        client.inbox.get_nowait()  # replace the whole body with half of it, then a disconnect
        client.inbox.put_nowait({"type": "http.request", "body": PROMPT[:10], "more_body": True})
        client.disconnect()
        await guard(http_scope(), client.receive, client.send)
        assert client.sent == [] and app.num_calls == 0
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_offered_total", **lab) == 1
        assert sample(guard, "kvguard_requests_canceled_total", **lab) == 1
        assert (sample(guard, "kvguard_requests_admitted_total", **lab) or 0) == 0
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_a_body_over_the_limit_is_413_and_never_reaches_the_app():
    async def main():
        app = StreamApp()
        guard = make_guard(app, policy=SlotPolicy(num_slots=1), max_body_bytes=64)
        client = Client(PROMPT + b" " * 64)
        await guard(http_scope(), client.receive, client.send)
        assert client.status == 413 and app.num_calls == 0
        assert client.headers["x-should-retry"] == "false"
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_shed_is_503_with_retry_headers_and_app_untouched():
    async def main():
        app = StreamApp()
        guard = make_guard(app, policy=SlotPolicy(num_slots=0, queue_s=None))
        client = Client(PROMPT)
        await guard(http_scope(), client.receive, client.send)
        assert client.status == 503 and app.num_calls == 0
        h = client.headers
        assert h["x-kvguard-reason"] == "overloaded" and h["x-should-retry"] == "true"
        assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) > 0
        assert json.loads(client.body)["error"]["code"] == "overloaded"
        assert sample(guard, "kvguard_requests_rejected_total", **{"class": "interactive", "tenant": "anonymous", "reason": "overloaded"}) == 1
        assert_at_rest(guard)
        await guard.aclose()
    run(main())


def test_unknown_key_is_401_when_anonymous_not_allowed():
    async def main():
        app = StreamApp()
        guard = make_guard(app, allow_anonymous=False,
                           tenants=(__import__("guard.config").config.TenantConfig("acme", hash_api_key("sk-good")),))
        bad = Client(PROMPT)
        await guard(http_scope(headers=[(b"authorization", b"Bearer sk-bad")]), bad.receive, bad.send)
        assert bad.status == 401 and bad.headers["x-should-retry"] == "false"
        good = Client(PROMPT)
        await guard(http_scope(headers=[(b"authorization", b"Bearer sk-good")]), good.receive, good.send)
        assert good.status == 200 and app.num_calls == 1
        assert guard.controller.policy.samples[0].tenant == "acme"
        await guard.aclose()
    run(main())


def test_other_paths_pass_through_and_guard_metrics_are_served():
    async def main():
        calls = []

        async def app(scope, receive, send):
            calls.append((scope["method"], scope["path"]))
            status = 404 if scope["path"] == "/metrics" else 200
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"inner", "more_body": False})

        guard = make_guard(app)
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/kvguard/state"),
                             ("GET", "/v1/completions")):
            c = Client(b"")
            await guard(http_scope(path, method), c.receive, c.send)
            assert c.status == 200 and c.body == b"inner"
        c = Client(b"")
        await guard(http_scope("/kvguard/metrics", "GET"), c.receive, c.send)
        assert b"kvguard_requests_offered_total" in c.body and b"kvguard_held_tickets 0.0" in c.body
        c = Client(b"")
        await guard(http_scope("/metrics", "GET"), c.receive, c.send)  # inner 404 -> the guard's
        assert c.status == 200 and b"kvguard_queue_length" in c.body
        assert ("GET", "/metrics") in calls and ("GET", "/kvguard/metrics") not in calls
        await guard.aclose()
    run(main())


def test_lifespan_passes_through_and_shutdown_stops_background_tasks():
    async def main():
        seen = []

        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                while True:
                    message = await receive()
                    seen.append(message["type"])
                    await send({"type": message["type"] + ".complete"})
                    if message["type"] == "lifespan.shutdown":
                        return
            await StreamApp()(scope, receive, send)

        guard = make_guard(app)
        c = Client(PROMPT)
        await guard(http_scope(), c.receive, c.send)
        assert guard.controller.background.tasks
        inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
        out = []

        async def receive():
            return inbox.pop(0)

        async def send(message):
            out.append(message["type"])

        await guard({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
        assert seen == ["lifespan.startup", "lifespan.shutdown"]
        assert out == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
        assert guard.controller.background.tasks == []
    run(main())


def test_in_process_state_is_polled_from_the_wrapped_app():
    from prometheus_client import CollectorRegistry

    from guard.config import GuardConfig
    from guard.middleware import AdmissionMiddleware
    from tests.support.admission import state_doc

    async def main():
        inner = StreamApp()

        async def app(scope, receive, send):
            if scope["path"] == "/kvguard/state":
                body = json.dumps(state_doc(num_free_blocks=77)).encode()
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": body})
                return
            await inner(scope, receive, send)

        return app

    app = asyncio.run(main())
    guard = AdmissionMiddleware(app, GuardConfig(policy="always-admit"), registry=CollectorRegistry())

    async def one_request():
        c = Client(PROMPT)
        await guard(http_scope(), c.receive, c.send)
        assert c.status == 200
        replica = guard.controller.load_state.replica_snapshot("local")
        assert replica.num_free_blocks == 77 and replica.healthy
        assert guard.controller.background.poller is not None and guard.controller.background.poller.num_refreshes >= 1
        return guard.controller.background.poller

    first = run(one_request())
    second = run(one_request())  # a new event loop (no aclose): the poller starts over on it
    assert second is not first and guard.controller.tickets.num_held == 0
    run(guard.aclose())


def test_no_arg_construction_reads_kvguard_config(tmp_path, monkeypatch):
    from guard.middleware import AdmissionMiddleware

    path = tmp_path / "guard.toml"
    path.write_text('policy = "always-admit"\nmax_body_bytes = 4096\n')
    monkeypatch.setenv("KVGUARD_CONFIG", str(path))
    guard = AdmissionMiddleware(StreamApp())
    assert guard.config.max_body_bytes == 4096 and guard.controller.policy.name == "always-admit"


def test_ttft_forecast_error_and_loop_lag_are_exported():
    async def main():
        clock = FakeClock(1.0)
        guard = make_guard(StreamApp(), clock=clock)  # SlotPolicy forecasts 0.1 s
        client = Client(PROMPT)
        client.on_send = lambda m: clock.advance(0.2) if m["type"] == "http.response.start" else None
        await guard(http_scope(), client.receive, client.send)
        assert sample(guard, "kvguard_ttft_forecast_ratio", stat="p50") == pytest.approx(0.5)
        assert sample(guard, "kvguard_ttft_forecast_ratio", stat="p90") == pytest.approx(0.5)
        assert sample(guard, "kvguard_ttft_forecast_abs_error_ratio") == pytest.approx(0.5)
        assert guard.controller.registry.get_sample_value(
            "kvguard_event_loop_lag_max_seconds") is not None
        await guard.aclose()
    run(main())


def test_retry_budget_turns_sheds_into_do_not_retry_and_reaches_the_snapshot():
    """Every request is shed (503). 10 first attempts allow max(3, 10 %) = 3 retries: the first
    three sheds say "retry after X", the rest "do not retry" with no wait. Retries that come
    anyway count against the budget; the 4th is over it, which the policy sees."""
    async def main():
        over = []

        class Spy(SlotPolicy):
            def decide(self, cost, snapshot):
                over.append(snapshot.retry_budget.is_over(cost.tenant))
                return super().decide(cost, snapshot)

        guard = make_guard(StreamApp(), policy=Spy(num_slots=0, queue_s=None))
        advice = []
        for retry in (b"0",) * 10 + (b"1",) * 4:
            c = Client(PROMPT)
            await guard(http_scope(headers=[(b"x-stainless-retry-count", retry)]), c.receive, c.send)
            assert c.status == 503
            advice.append((c.headers["x-should-retry"], "retry-after-ms" in c.headers))
        assert advice == [("true", True)] * 3 + [("false", False)] * 11
        assert over == [False] * 13 + [True]
        window = {kind: sample(guard, "kvguard_retry_budget_window", kind=kind)
                  for kind in ("first_attempts", "retries", "advised")}
        assert window == {"first_attempts": 10, "retries": 4, "advised": 3}
        await guard.aclose()
    run(main())


def test_policy_never_servable_is_400_without_retry_after():
    async def main():
        from policies.decision import Shed

        class Never(SlotPolicy):
            def decide(self, cost, snapshot):
                return Shed(400, "context_length_exceeded", should_retry=False)

        app = StreamApp()
        guard = make_guard(app, policy=Never())
        c = Client(PROMPT)
        await guard(http_scope(), c.receive, c.send)
        assert c.status == 400 and c.headers["x-should-retry"] == "false"
        assert "retry-after" not in c.headers and app.num_calls == 0
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, "kvguard_requests_offered_total", **lab) == 1
        assert sample(guard, "kvguard_requests_rejected_total", reason="context_length_exceeded", **lab) == 1
        await guard.aclose()
    run(main())


def test_a_filled_in_max_tokens_is_said_on_the_response():
    """No max_tokens sent: the app gets the priced value and the response names it; a client
    that sent one gets no such header."""
    seen = []

    async def app(scope, receive, send):
        seen.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = make_guard(app)

    async def main():
        answers = []
        for body in (b'{"model": "tiny", "prompt": "hi"}',
                     b'{"model": "tiny", "prompt": "hi", "max_tokens": 5}'):
            client = Client(body)
            await guard(http_scope(), client.receive, client.send)
            answers.append(client.headers)
        await guard.aclose()
        return answers

    filled, sent = asyncio.run(main())
    assert filled["x-kvguard-max-tokens"] == str(seen[0]["max_tokens"])
    assert "x-kvguard-max-tokens" not in sent and seen[1]["max_tokens"] == 5


def test_the_client_request_id_is_echoed_on_admits_and_sheds():
    """The app (like a kvguard engine) echoes the x-request-id it got, the guard's: the client
    still gets its own back, and the guard's in x-kvguard-request-id; a shed echoes it too."""
    from policies.decision import Shed

    async def app(scope, receive, send):
        await receive()
        echoed = dict(scope["headers"])[b"x-request-id"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-request-id", echoed)]})
        await send({"type": "http.response.body", "body": b"{}"})

    class Shedding:
        def decide(self, cost, snapshot):
            return Shed(503, "overloaded", retry_after_s=1.0)

    async def one(guard, request_id):
        client = Client(PROMPT)
        await guard(http_scope(headers=[(b"x-request-id", request_id)]), client.receive,
                    client.send)
        await guard.aclose()
        return client.headers

    admitted = asyncio.run(one(make_guard(app), b"client-1"))
    assert admitted["x-request-id"] == "client-1"
    assert admitted["x-kvguard-request-id"] not in ("", "client-1")
    shed = asyncio.run(one(make_guard(app, policy=Shedding()), b"client-2"))
    assert shed["x-request-id"] == "client-2" and shed["x-kvguard-request-id"]
    insane = asyncio.run(one(make_guard(app), "clïent".encode()))
    assert insane["x-request-id"] == insane["x-kvguard-request-id"]  # replaced by the guard's


def _response_event(kind, **fields):
    return (f"event: {kind}\ndata: " + json.dumps({"type": kind, **fields}) + "\n\n").encode()


class ResponsesApp:
    """A /v1/responses stream: typed events, no [DONE]; ``end`` is its last event (None: the
    body ends without one)."""

    def __init__(self, end="response.completed"):
        self.end = end

    async def __call__(self, scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        events = [_response_event("response.created", response={"status": "in_progress"})]
        events += [_response_event("response.output_text.delta", delta=t) for t in "abc"]
        if self.end is not None:
            events.append(_response_event(self.end, response={
                "status": "completed", "usage": {"input_tokens": 4, "output_tokens": 3}}))
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("end, outcome", [("response.completed", "completed"),
                                          ("response.failed", "failed"), (None, "failed")])
def test_responses_stream_is_admitted_by_default_and_judged_by_its_end_event(end, outcome):
    async def main():
        guard = make_guard(ResponsesApp(end))
        body = json.dumps({"model": "tiny", "input": "hello", "max_output_tokens": 8,
                           "stream": True}).encode()
        client = Client(body)
        await guard(http_scope("/v1/responses"), client.receive, client.send)
        assert client.status == 200 and "x-kvguard-queue-ms" in client.headers
        lab = {"class": "interactive", "tenant": "anonymous"}
        assert sample(guard, f"kvguard_requests_{outcome}_total", **lab) == 1
        assert sample(guard, "kvguard_goodput_total", **lab) == (outcome == "completed")
        assert_at_rest(guard)
        await guard.aclose()

    run(main())
