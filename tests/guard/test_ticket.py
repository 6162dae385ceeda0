from guard.admission.ticket import TicketBook
from tests.support.admission import FakeClock, make_cost, reserved

SSE = b"text/event-stream"


def _book(clock, calls):
    return TicketBook(clock, (lambda t: calls.append((t.request_id, t.outcome)),))


def test_release_runs_listeners_exactly_once():
    clock, calls = FakeClock(5.0), []
    book = _book(clock, calls)
    ticket = book.issue(reserved(make_cost("a")), dispatch_s=5.0)
    assert book.num_held == 1
    assert ticket.release("canceled") is True
    assert ticket.release("completed") is False
    assert ticket.release("failed") is False
    assert calls == [("a", "canceled")]
    assert ticket.outcome == "canceled" and ticket.released_s == 5.0
    assert book.num_held == 0


def test_bad_outcome_is_a_value_error_and_keeps_the_ticket():
    book = _book(FakeClock(), [])
    ticket = book.issue(reserved(make_cost()), 0.0)
    try:
        ticket.release("ok")
    except ValueError as exc:
        assert "outcome" in str(exc)
    else:
        raise AssertionError("expected ValueError")
    assert book.num_held == 1 and not ticket.released


def test_failing_listener_still_releases_and_runs_the_rest():
    clock, calls = FakeClock(), []

    def boom(ticket):
        raise RuntimeError("listener bug")

    book = TicketBook(clock, (boom, lambda t: calls.append(t.outcome)))
    ticket = book.issue(reserved(make_cost()), 0.0)
    assert ticket.release("failed") is True
    assert calls == ["failed"] and book.num_held == 0


def test_stream_observation_and_goodput():
    clock = FakeClock()
    book = _book(clock, [])
    ticket = book.issue(reserved(make_cost(arrival_s=0.0)), 0.0, predicted_ttft_s=0.4)
    ticket.on_start(200, SSE)
    assert ticket.on_body(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', True, 0.1) is None
    assert ticket.first_byte_s == 0.1 and ticket.first_token_s is None
    assert ticket.on_body(b'data: {"choices":[{"text":"hi"}]}\n\n', True, 0.5) is None
    gap = ticket.on_body(b'data: {"choices":[{"text":" there"}]}\n\n', True, 0.57)
    assert abs(gap - 0.07) < 1e-9
    ticket.on_body(b"data: [DONE]\n\n", False, 0.6)
    assert ticket.ttft_s == 0.5 and ticket.num_content_chunks == 2 and ticket.done_seen
    assert ticket.natural_outcome() == "completed"
    clock.now_s = 0.6
    ticket.release(ticket.natural_outcome())
    assert ticket.met_slo()
    sample = ticket.sample()
    assert sample.ok and sample.met_slo and sample.ttft_s == 0.5 and sample.num_output_tokens == 2


def test_slow_gap_or_late_first_token_is_not_goodput():
    book = _book(FakeClock(), [])
    slow_gap = book.issue(reserved(make_cost(arrival_s=0.0)), 0.0)
    slow_gap.on_start(200, SSE)
    slow_gap.on_body(b'data: {"text":"a"}\n\n', True, 0.1)
    slow_gap.on_body(b'data: {"text":"b"}\n\n', True, 0.3)  # 200 ms > 80 ms ITL
    slow_gap.on_body(b"data: [DONE]\n\n", False, 0.31)
    slow_gap.release("completed")
    assert not slow_gap.met_slo() and slow_gap.sample().ok

    late = book.issue(reserved(make_cost(arrival_s=0.0)), 0.0)
    late.on_start(200, b"application/json")
    late.on_body(b'{"choices":[{"text":"x"}]}', False, 1.5)  # TTFT 1.5 s > 1.0 s
    late.release(late.natural_outcome())
    assert late.outcome == "completed" and not late.met_slo()


def test_truncated_stream_or_error_status_is_failed():
    book = _book(FakeClock(), [])
    cut = book.issue(reserved(make_cost()), 0.0)
    cut.on_start(200, SSE)
    cut.on_body(b'data: {"text":"a"}\n\n', True, 0.1)
    cut.on_body(b"", False, 0.2)  # stream ended without [DONE]
    assert cut.natural_outcome() == "failed"
    err = book.issue(reserved(make_cost("e")), 0.0)
    err.on_start(500, b"application/json")
    err.on_body(b'{"error":{}}', False, 0.1)
    assert err.natural_outcome() == "failed"
    gone = book.issue(reserved(make_cost("g")), 0.0)
    gone.on_start(200, SSE)
    gone.client_disconnected = True
    assert gone.natural_outcome() == "canceled"


def test_natural_outcomes_are_honest():
    book = _book(FakeClock(), [])
    aborted = book.issue(reserved(make_cost("a")), 0.0)
    aborted.on_start(200, SSE)
    aborted.on_body(b'data: {"choices": [{"text": "x"}]}\n\n', True, 0.1)
    aborted.on_body(b'data: {"choices": [{"text": "", "finish_reason": "abort"}]}\n\n', True, 0.2)
    aborted.on_body(b"data: [DONE]\n\n", False, 0.3)
    assert aborted.natural_outcome() == "failed"  # the replica cut it short: never good

    left = book.issue(reserved(make_cost("b")), 0.0)
    left.on_disconnect()  # a non-streaming client gave up; the app answers afterwards
    left.on_start(500, b"application/json")
    left.on_body(b'{"error": {}}', False, 0.5)
    assert left.natural_outcome() == "canceled"

    refused = book.issue(reserved(make_cost("c")), 0.0)
    refused.on_start(400, b"application/json")
    refused.on_body(b'{"error": {"code": "unsupported_parameter"}}', False, 0.1)
    assert refused.natural_outcome() == "rejected_upstream"

    done = book.issue(reserved(make_cost("d")), 0.0)
    done.on_start(200, b"application/json")
    done.on_body(b'{"choices": [{"finish_reason": "length"}]}', False, 0.1)
    done.on_disconnect()  # after the last chunk: too late to matter
    assert done.natural_outcome() == "completed"


def test_sample_says_who_canceled_and_after_how_long():
    """The policy learns client patience only from the client's own disconnects."""
    clock = FakeClock(0.0)
    book = _book(clock, [])
    left = book.issue(reserved(make_cost("left")), 0.0)  # the cost arrived at 0.0
    left.on_start(200, SSE)
    left.on_disconnect()
    clock.now_s = 6.0
    left.release(left.natural_outcome())
    sample = left.sample()
    assert (sample.outcome, sample.client_left, sample.elapsed_s) == ("canceled", True, 6.0)
    ours = book.issue(reserved(make_cost("ours")), 0.0)  # our task cancelled (shutdown)
    ours.release("canceled")
    assert (ours.sample().outcome, ours.sample().client_left) == ("canceled", False)
    done = book.issue(reserved(make_cost("done")), 0.0)
    done.release("completed")
    assert (done.sample().outcome, done.sample().client_left) == ("completed", False)


def _responses_ticket(clock):
    class Priced:  # what the ticket reads of the pricing record
        responses = True

    ticket = _book(clock, []).issue(reserved(make_cost(arrival_s=0.0)), 0.0, priced=Priced())
    ticket.on_start(200, SSE)
    return ticket


def _event(kind, **fields):
    import json
    return (f"event: {kind}\ndata: " + json.dumps({"type": kind, **fields}) + "\n\n").encode()


def test_responses_stream_ends_with_its_completed_event_not_done():
    """A /v1/responses stream: the first token is the first output_text delta (not the
    created/in-progress events), usage is input/output tokens, response.completed finishes."""
    ticket = _responses_ticket(FakeClock())
    created = {"response": {"status": "in_progress", "output": [], "usage": None}}
    assert ticket.on_body(_event("response.created", **created), True, 0.1) is None
    ticket.on_body(_event("response.content_part.added", part={"type": "output_text", "text": ""}),
                   True, 0.2)
    assert ticket.first_token_s is None
    ticket.on_body(_event("response.output_text.delta", delta="hi"), True, 0.3)
    gap = ticket.on_body(_event("response.output_text.delta", delta=" there"), True, 0.35)
    assert abs(gap - 0.05) < 1e-9
    ticket.on_body(_event("response.output_text.done", text="hi there"), True, 0.4)
    assert ticket.num_content_chunks == 2 and not ticket.done_seen
    done = {"response": {"status": "completed", "output": [{"content": [{"text": "hi there"}]}],
                         "usage": {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0},
                                   "output_tokens": 2, "total_tokens": 13}}}
    ticket.on_body(_event("response.completed", **done), True, 0.45)
    ticket.on_body(b"", False, 0.45)
    assert ticket.ttft_s == 0.3 and ticket.done_seen and ticket.finish_seen
    assert (ticket.num_usage_prompt_tokens, ticket.num_usage_output_tokens) == (11, 2)
    assert ticket.natural_outcome() == "completed"


def test_responses_stream_incomplete_counts_finished_failed_or_cut_does_not():
    for last, outcome in ((_event("response.incomplete", response={"status": "incomplete"}),
                           "completed"),
                          (_event("response.failed", response={"status": "failed"}), "failed"),
                          (_event("error", code="boom", message="m"), "failed"),
                          (b"", "failed")):  # cut: the body ended with no end event
        ticket = _responses_ticket(FakeClock())
        ticket.on_body(_event("response.output_text.delta", delta="x"), True, 0.1)
        ticket.on_body(last, False, 0.2)
        assert ticket.natural_outcome() == outcome, last


def test_responses_text_that_names_an_event_is_only_text():
    ticket = _responses_ticket(FakeClock())
    ticket.on_body(_event("response.output_text.delta",
                          delta='"type": "response.completed"'), True, 0.1)
    ticket.on_body(b"", False, 0.2)
    assert not ticket.done_seen and ticket.natural_outcome() == "failed"


def test_a_whole_responses_body_that_says_failed_is_no_completion():
    """A non-streamed /v1/responses answer is a 200 whatever happened: its ``status`` says."""
    import json
    for status, outcome in (("completed", "completed"), ("incomplete", "completed"),
                            ("failed", "failed")):
        ticket = _responses_ticket(FakeClock())
        ticket.on_start(200, b"application/json")
        body = {"object": "response", "status": status,
                "output": [{"type": "message", "status": "completed",
                            "content": [{"type": "output_text", "text": 'say "status": "failed"'}]}],
                "usage": {"input_tokens": 5, "output_tokens": 3}}
        ticket.on_body(json.dumps(body).encode(), False, 0.2)
        assert ticket.natural_outcome() == outcome, status
