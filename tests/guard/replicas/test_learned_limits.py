"""What an ended request tells the learned limit, and the limit carried on the snapshots."""

import json

import pytest

from guard.admission.ticket import TicketBook
from guard.replicas.learned_limits import FirstTokenTime, LearnedLimits, signal_of
from guard.replicas.load_state import LoadState
from policies.concurrency_limit import GOOD, IGNORED, OVERLOADED, ConcurrencyLimit
from tests.support.admission import FakeClock, make_cost

SSE = b"text/event-stream"


def chunk(text: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class Guard:
    """A load state, a ticket book freeing reservations then feeding the limits, a clock."""

    def __init__(self, initial_limit: float = 2) -> None:
        self.clock = FakeClock(10.0)
        self.load_state = LoadState()
        self.load_state.mark_unknown_capacity("r0", 10.0)
        self.limits = LearnedLimits(self.load_state, lambda: ConcurrencyLimit(initial_limit))
        self.book = TicketBook(self.clock, (lambda t: self.load_state.release(t.request_id),
                                            self.limits.on_released))
        self.num = 0

    def start(self):
        self.num += 1
        cost = make_cost(f"q{self.num}", arrival_s=self.clock.now_s)
        reservation = self.load_state.reserve("r0", cost.request_id, cost)
        return self.book.issue(reservation, dispatch_s=self.clock.now_s)

    def stream(self, ticket, chunks, *, ttft_s=0.1, gap_s=0.02, status=200, outcome="completed"):
        ticket.on_start(status, SSE)
        self.clock.advance(ttft_s)
        for c in chunks:
            ticket.on_body(c, True, self.clock.now_s)
            self.clock.advance(gap_s)
        ticket.on_body(b"data: [DONE]\n\n", False, self.clock.now_s)
        ticket.release(outcome)
        return signal_of(ticket)


WHOLE = [chunk("a"), chunk("b"), chunk("", "stop")]


@pytest.mark.parametrize("kwargs, chunks, expected", [
    ({}, WHOLE, GOOD),
    ({"ttft_s": 1.5}, WHOLE, OVERLOADED),  # first token past the class TTFT (1 s)
    ({"gap_s": 0.5}, WHOLE, OVERLOADED),  # a gap past the class ITL
    ({}, [chunk("a"), chunk("b")], OVERLOADED),  # [DONE] without a finish_reason: interrupted
    ({"status": 503, "outcome": "failed"}, [], OVERLOADED),
    ({"status": 429, "outcome": "rejected_upstream"}, [], OVERLOADED),
    ({"status": 400, "outcome": "rejected_upstream"}, [], IGNORED),
    ({"outcome": "canceled"}, WHOLE[:1], IGNORED),
])
def test_signal_of_an_ended_stream(kwargs, chunks, expected):
    guard = Guard()
    assert guard.stream(guard.start(), chunks, **kwargs) == expected


def test_ttft_counts_from_dispatch_not_from_arrival():
    guard = Guard()
    cost = make_cost("late", arrival_s=0.0)  # 10 s in the guard's queue before dispatch
    ticket = guard.book.issue(guard.load_state.reserve("r0", "late", cost), dispatch_s=10.0)
    assert guard.stream(ticket, WHOLE) == GOOD


def test_a_replica_that_never_sends_finish_reason_is_judged_only_by_length():
    guard = Guard()
    whole = [chunk(str(i)) for i in range(16)]  # make_cost's max_tokens: ran to its limit
    for _ in range(3):
        assert guard.stream(guard.start(), whole) == GOOD
    assert guard.limits.limit("r0").num_cuts == 0
    assert guard.stream(guard.start(), whole[:3]) == OVERLOADED  # stopped short, no reason


def test_the_limit_is_carried_on_the_snapshot_and_cut_by_interruptions():
    guard = Guard(initial_limit=2)
    first, second = guard.start(), guard.start()
    guard.stream(first, WHOLE)  # good at its limit (2 in flight): 2 -> 2.5
    assert guard.load_state.replica_snapshot("r0").concurrency_limit == 2
    guard.stream(second, [chunk("a")])  # interrupted: 2.5 x 0.7 = 1.75
    assert guard.load_state.replica_snapshot("r0").concurrency_limit == 1
    assert guard.limits.values() == {"r0": 1}


def test_first_token_time_is_an_upper_estimate_like_tcps_timeout():
    estimate = FirstTokenTime(0.1)
    assert (estimate.mean_s, estimate.deviation_s) == (0.1, 0.05)
    assert estimate.upper_s == pytest.approx(0.3)
    for _ in range(50):
        estimate.add(0.1)  # steady: the deviation decays, the bound closes in on the mean
    assert estimate.upper_s == pytest.approx(0.1, abs=0.001)
    estimate.add(0.5)  # one slow first token widens it at once
    assert estimate.upper_s > 0.5


def test_the_snapshot_carries_the_first_token_upper_estimate():
    guard = Guard()
    guard.stream(guard.start(), WHOLE, ttft_s=0.2)
    snap = guard.load_state.replica_snapshot("r0")
    assert snap.first_token_s == pytest.approx(0.2 + 4 * 0.1)
    assert guard.limits.first_token_s("r0") == snap.first_token_s
