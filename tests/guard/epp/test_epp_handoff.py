"""The split config's EPP side without Envoy: :class:`guard.epp.handoff.Handoffs` with an
injected scheduler, and the ext_proc stream loop driven with real protobuf messages over a real
controller (a decision stream that hands the ticket off, observer streams that claim it)."""

import asyncio

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from test_epp_picker import BODY, HEADERS, SSE, make_picker

from guard.epp import messages
from guard.epp.handoff import Handoffs
from guard.epp.processor import ExternalProcessor

Mode = processing_mode_pb2.ProcessingMode


class ManualTimers:
    """A scheduler whose callbacks run when the test says so."""

    def __init__(self):
        self.pending = []

    def __call__(self, delay_s, callback):
        timer = _Timer(delay_s, callback)
        self.pending.append(timer)
        return timer

    def fire(self):
        for timer in self.pending:
            if not timer.cancelled:
                timer.callback()


class _Timer:
    def __init__(self, delay_s, callback):
        self.delay_s, self.callback, self.cancelled = delay_s, callback, False

    def cancel(self):
        self.cancelled = True


class FakeExchange:
    request_id = "g-1"

    def __init__(self):
        self.closed = []

    def close(self, reset):
        self.closed.append(reset)


def test_a_token_is_claimed_once_and_unknown_tokens_claim_nothing():
    timers = ManualTimers()
    handoffs = Handoffs(2.0, timers)
    exchange = FakeExchange()
    token = handoffs.hand_off(exchange)
    assert len(token) == 32 and timers.pending[0].delay_s == 2.0
    assert handoffs.claim("0" * 32) is None and handoffs.claim(None) is None
    assert handoffs.claim(token) is exchange and timers.pending[0].cancelled
    assert handoffs.claim(token) is None and len(handoffs) == 0
    assert handoffs.hand_off(FakeExchange()) != token  # a fresh random token each time


def test_an_unclaimed_token_is_released_after_the_wait_and_cannot_be_claimed_later():
    timers = ManualTimers()
    handoffs = Handoffs(2.0, timers)
    exchange = FakeExchange()
    token = handoffs.hand_off(exchange)
    timers.fire()
    assert exchange.closed == [False] and handoffs.num_unobserved == 1
    assert handoffs.claim(token) is None
    waiting = FakeExchange()
    handoffs.hand_off(waiting)
    handoffs.close()  # the server stops: nothing stays held
    assert waiting.closed == [False] and len(handoffs) == 0


def test_the_wait_must_be_positive():
    with pytest.raises(ValueError, match="observer wait"):
        Handoffs(0.0)


class FakeContext:
    def add_done_callback(self, callback):
        pass


def _headers(values: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in values.items()])


def _decision_stream(response_body_mode=Mode.NONE):
    config = ext_proc.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED,
                                            response_body_mode=response_body_mode)
    return [ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(
                headers=_headers(HEADERS)), protocol_config=config),
            ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=BODY,
                                                                      end_of_stream=True))]


def _observer_stream(token, chunks=SSE, end=True):
    metadata = base_pb2.Metadata()
    if token is not None:
        metadata.filter_metadata["kvguard"].update({"ticket": token})
    stream = [
        ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(
            headers=_headers(HEADERS)), observability_mode=True, metadata_context=metadata),
        ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(headers=_headers(
            {":status": "200", "content-type": "text/event-stream"})), observability_mode=True,
            metadata_context=metadata)]
    stream += [ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(
        body=chunk, end_of_stream=end and chunk is chunks[-1]), observability_mode=True,
        metadata_context=metadata) for chunk in chunks]
    return stream


async def _process(processor, stream):
    async def incoming():
        for message in stream:
            yield message
    return [r async for r in processor.Process(incoming(), FakeContext())]


def _token(answers):
    ours = answers[0].dynamic_metadata.fields.get("kvguard")
    return None if ours is None else ours.struct_value.fields["ticket"].string_value


def test_the_decision_hands_the_ticket_to_the_observer_that_carries_its_token():
    async def main():
        picker = make_picker()
        await picker.controller.start()
        processor = ExternalProcessor(picker, Handoffs(30.0))
        tickets = picker.controller.tickets
        answers = await _process(processor, _decision_stream())
        assert answers[0].WhichOneof("response") == "request_headers"
        token = _token(answers)
        ours = answers[0].dynamic_metadata.fields["kvguard"].struct_value.fields
        assert ours["replica"].string_value in ("r0", "r1") and "queue-ms" in ours
        assert tickets.num_held == 1  # the decision stream ended; the ticket waits
        # a forged or stale token, and an observer with none, claim nothing and answer nothing
        assert await _process(processor, _observer_stream("f" * 32)) == []
        assert await _process(processor, _observer_stream(None)) == []
        assert tickets.num_held == 1
        held = next(iter(processor.handoffs._waiting.values()))[0].admitted.ticket
        assert await _process(processor, _observer_stream(token)) == []  # never answers
        assert held.outcome == "completed" and held.num_output_tokens == 2
        assert held.first_token_s is not None and tickets.num_held == 0
        await picker.controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))


def test_an_observer_stream_that_ends_before_the_response_did_cancels_the_ticket():
    async def main():
        picker = make_picker()
        await picker.controller.start()
        processor = ExternalProcessor(picker, Handoffs(30.0))
        token = _token(await _process(processor, _decision_stream()))
        held = next(iter(processor.handoffs._waiting.values()))[0].admitted.ticket
        await _process(processor, _observer_stream(token, SSE[:1], end=False))
        assert held.outcome == "canceled" and picker.controller.tickets.num_held == 0
        await picker.controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_stream_that_carries_its_response_sets_no_token():
    async def main():
        picker = make_picker()
        await picker.controller.start()
        processor = ExternalProcessor(picker, Handoffs(30.0))
        answers = await _process(processor, _decision_stream(Mode.FULL_DUPLEX_STREAMED))
        assert _token(answers) is None and len(processor.handoffs) == 0
        await picker.controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))


def test_observer_messages_read_and_built():
    message = _observer_stream("abc")[0]
    assert messages.observer_token(message) == "abc"
    assert messages.observer_token(_observer_stream(None)[0]) is None
    assert messages.response_elsewhere(_decision_stream()[0])
    assert not messages.response_elsewhere(_decision_stream(Mode.FULL_DUPLEX_STREAMED)[0])
    assert not messages.response_elsewhere(_decision_stream()[1])  # no protocol_config


def test_a_named_epp_puts_its_id_beside_the_token_for_envoys_routes():
    async def main():
        picker = make_picker()
        await picker.controller.start()
        processor = ExternalProcessor(picker, Handoffs(30.0, epp_id="epp-1"))
        answers = await _process(processor, _decision_stream())
        ours = answers[0].dynamic_metadata.fields["kvguard"].struct_value.fields
        assert ours["epp"].string_value == "epp-1" and ours["ticket"].string_value
        unnamed = ExternalProcessor(picker, Handoffs(30.0))
        ours = (await _process(unnamed, _decision_stream()))[0].dynamic_metadata.fields[
            "kvguard"].struct_value.fields
        assert "epp" not in ours
        processor.handoffs.close()
        unnamed.handoffs.close()
        await picker.controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))
    with pytest.raises(ValueError, match="epp id"):
        Handoffs(1.0, epp_id="")


def test_an_observer_stream_may_open_with_the_response_headers():
    """A config whose observer skips the request headers: the token comes with the response
    headers, which count (the status)."""
    async def main():
        picker = make_picker()
        await picker.controller.start()
        processor = ExternalProcessor(picker, Handoffs(30.0))
        token = _token(await _process(processor, _decision_stream()))
        held = next(iter(processor.handoffs._waiting.values()))[0].admitted.ticket
        await _process(processor, _observer_stream(token)[1:])
        assert (held.outcome, held.status) == ("completed", 200)
        await picker.controller.aclose()
    asyncio.run(asyncio.wait_for(main(), 10))
