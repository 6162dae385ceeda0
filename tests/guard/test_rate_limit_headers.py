"""guard.admission.rate_limit_headers: OpenAI's x-ratelimit-* headers and duration format."""

from guard.admission.rate_limit_headers import duration_text, rate_limit_headers
from guard.budget.store import BudgetLimits


def test_durations_are_written_as_openai_writes_them():
    assert [duration_text(s) for s in (0.0, 0.0201, 0.999, 1.0, 1.5, 59.9984, 360.0, 61.25)] \
        == ["0ms", "21ms", "999ms", "1s", "1.5s", "59.999s", "6m0s", "1m1.25s"]


def test_admitted_headers_give_what_is_left_and_when_it_is_full_again():
    limits = BudgetLimits(tokens_per_minute=1000, requests_per_minute=10)
    headers = dict(rate_limit_headers(limits, remaining=(750.4, 9.0)))
    assert headers == {
        b"x-ratelimit-limit-requests": b"10", b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-requests": b"9", b"x-ratelimit-reset-requests": b"6s",
        b"x-ratelimit-remaining-tokens": b"750", b"x-ratelimit-reset-tokens": b"14.976s"}
    # an axis the store does not know, or the tenant does not have, says nothing; a level
    # below zero (settled over its reservation) reads 0
    only = dict(rate_limit_headers(BudgetLimits(requests_per_minute=10), remaining=(None, -2.0)))
    assert only[b"x-ratelimit-remaining-requests"] == b"0"
    assert only[b"x-ratelimit-reset-requests"] == b"1m0s"
    assert b"x-ratelimit-remaining-tokens" not in only
    assert b"x-ratelimit-remaining-requests" not in dict(rate_limit_headers(limits))


def test_a_budget_429_says_the_axis_that_refused_and_its_wait():
    headers = dict(rate_limit_headers(BudgetLimits(requests_per_minute=10), "rpm_limit", 0.25))
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"250ms"
