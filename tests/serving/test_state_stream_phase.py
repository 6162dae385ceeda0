"""``serve_state_stream(phase=...)``: the events after the first come that fraction of the
interval later, so streams a guard opened at once need not stay in step; a bad phase is
refused before anything is sent."""

from __future__ import annotations

import asyncio

import pytest

from chaos.state_replica import StateReplica
from engine.compact_state import compact_state
from serving import state_delta
from serving.state_delta import serve_state_stream


def _waits(monkeypatch, phase: float, interval_ms: int = 1000, num_events: int = 3) -> list:
    """The timeouts the stream waited with between ``num_events`` events (asyncio.wait
    replaced: it returns at once and records its timeout; then the client goes away)."""
    timeouts: list[float] = []
    events: list[bytes] = []
    doc = compact_state(StateReplica(lambda p, d, c: 0.004, num_total_blocks=60).state())

    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        real_wait = asyncio.wait

        async def wait(fs, timeout=None):
            timeouts.append(timeout)
            if len(timeouts) == num_events:
                inbox.put_nowait({"type": "http.disconnect"})
                return await real_wait(fs)  # until the disconnect is read
            return set(), set(fs)

        async def send(message):
            if message.get("body"):
                events.append(message["body"])

        monkeypatch.setattr(state_delta.asyncio, "wait", wait)
        scope = {"type": "http", "query_string": f"interval_ms={interval_ms}".encode()}
        await serve_state_stream(scope, inbox.get, send, lambda: doc, phase=phase)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert len(events) == num_events
    return timeouts


def test_a_phase_puts_the_second_event_that_much_of_an_interval_later(monkeypatch):
    first, *rest = _waits(monkeypatch, phase=0.5)
    assert 1.0 < first <= 1.5  # 1.5 intervals less the time the first event took to encode
    assert rest and all(t <= 1.0 for t in rest)  # then every interval


def test_no_phase_keeps_every_event_one_interval_apart(monkeypatch):
    assert all(t <= 1.0 for t in _waits(monkeypatch, phase=0.0))


@pytest.mark.parametrize("phase", [-0.1, 1.0, 2.5])
def test_a_bad_phase_is_refused_before_anything_is_sent(phase):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    with pytest.raises(ValueError, match="phase"):
        asyncio.run(serve_state_stream({"type": "http", "query_string": b""}, receive, send,
                                       dict, phase=phase))
    assert sent == []
