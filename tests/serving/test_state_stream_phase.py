"""``serve_state_stream(phase=...)`` and the client's ``?phase=F``: the events after the first
come that fraction of the interval later, so streams a guard opened at once need not stay in
step; the query's phase wins over the argument; a bad phase is refused before anything is
sent (the argument: ValueError; the query: a 400 and no stream)."""

from __future__ import annotations

import asyncio
import json

import pytest

from chaos.state_replica import StateReplica
from engine.compact_state import compact_state
from serving import state_delta
from serving.state_delta import serve_state_stream

_REAL_WAIT = asyncio.wait  # before any test replaces it (more than one _waits in a test)


def _waits(monkeypatch, phase: float, interval_ms: int = 1000, num_events: int = 3,
           query: str = "") -> list:
    """The timeouts the stream waited with between ``num_events`` events (asyncio.wait
    replaced: it returns at once and records its timeout; then the client goes away)."""
    timeouts: list[float] = []
    events: list[bytes] = []
    doc = compact_state(StateReplica(lambda p, d, c: 0.004, num_total_blocks=60).state())

    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        real_wait = _REAL_WAIT

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
        scope = {"type": "http", "query_string": f"interval_ms={interval_ms}{query}".encode()}
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


def test_the_clients_phase_puts_the_second_event_that_much_of_an_interval_later(monkeypatch):
    first, *rest = _waits(monkeypatch, phase=0.0, query="&phase=0.5")
    assert 1.0 < first <= 1.5
    assert rest and all(t <= 1.0 for t in rest)


def test_the_clients_phase_wins_over_the_replicas_own(monkeypatch):
    first, *rest = _waits(monkeypatch, phase=0.75, query="&phase=0.25")
    assert 1.0 < first <= 1.25  # not 1.75
    assert all(t <= 1.0 for t in _waits(monkeypatch, phase=0.75, query="&phase=0"))
    first, *rest = _waits(monkeypatch, phase=0.75)  # none asked: the replica's own holds
    assert 1.25 < first <= 1.75


@pytest.mark.parametrize("value", ["-0.1", "1", "1.0", "2.5", "nan", "inf", "1e-3", "0.5x",
                                   "%200.5", "+0.5", "0,5", "0.5_0", "half"])
def test_a_bad_phase_query_is_a_400_and_no_stream(value):
    sent, asked = [], []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    def compact():
        asked.append(1)
        return {}

    scope = {"type": "http", "query_string": f"interval_ms=100&phase={value}".encode()}
    asyncio.run(asyncio.wait_for(serve_state_stream(scope, receive, send, compact), 10))
    assert sent[0]["status"] == 400
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert message.startswith("phase:") and "below 1" in message
    assert len(sent) == 2 and not asked  # no stream: nothing encoded, nothing more sent


@pytest.mark.parametrize("value,phase", [("0", 0.0), ("0.25", 0.25), (".5", 0.5),
                                         ("0.999999", 0.999999), ("0.", 0.0)])
def test_a_plain_decimal_fraction_is_a_phase(value, phase):
    assert state_delta.stream_phase(value) == phase


def test_no_phase_query_is_the_default():
    assert state_delta.stream_phase(None) == 0.0
    assert state_delta.stream_phase(None, 0.3) == 0.3


def test_spread_phases_are_distinct_and_in_range():
    phases = [state_delta.spread_phase(i) for i in range(1024)]
    assert phases[0] == 0.0 and all(0.0 <= p < 1.0 for p in phases)
    assert len(set(phases)) == len(phases)
    # evenly spread: the first 256 leave no gap wider than 3 / 256 of the interval
    ordered = sorted(phases[:256]) + [1.0]
    assert max(b - a for a, b in zip(ordered, ordered[1:], strict=False)) < 3 / 256
