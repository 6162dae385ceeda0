"""The chaos user clients against a real loopback SSE server: what each kind retries, how it
waits, and how its user is judged. Lower bounds on waits only (never an upper timing bound)."""

import asyncio
import socket

import httpx
import pytest

from chaos.clients import ClientConfig, EntryPicker
from chaos.records import RequestSpec
from chaos.users import UserRunConfig, assign_clients, run_users
from policies.cost import RequestClass

CLS = RequestClass("interactive", ttft_s=5.0, itl_s=2.0)


def _spec(tenant: int, index: int = 0, request_class: str = "interactive",
          max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(index=index, scheduled_s=0.0, num_prompt_tokens=8, max_tokens=max_tokens,
                       request_class=request_class, tenant=f"chaos-tenant-{tenant}")


def _serve(url, tenant, kind, *, drain_timeout_s=15.0, request_class="interactive",
           max_tokens=4, hang_grace_s=1.0, index=0, **client_kw):
    cfg = ClientConfig(kind=kind, **{"patience_s": 10.0, **client_kw})
    run = UserRunConfig(entry_urls=(url,), duration_s=0.1, drain_timeout_s=drain_timeout_s,
                        model="echo", hang_grace_s=hang_grace_s)
    result = asyncio.run(run_users([_spec(tenant, index, request_class, max_tokens)], [kind],
                                   {kind: cfg}, run))
    (user,) = result.users
    return user


def _server_attempts(url, tenant):
    doc = httpx.get(url + "/attempts", trust_env=False).json()
    return doc["attempts"].get(f"chaos-tenant-{tenant}", 0), \
        doc["retry_count_header"].get(f"chaos-tenant-{tenant}")


@pytest.mark.parametrize("kind", ["sdk", "tenacity", "bad_citizen"])
def test_plain_stream_is_one_good_attempt(echo_url, kind):
    user = _serve(echo_url, 0, kind, backoff_s=0.01, backoff_max_s=0.05)
    assert user.num_attempts == 1 and user.outcome(CLS) == "good"
    (a,) = user.attempts
    assert a.status == 200 and a.saw_done and a.num_tokens_received == 4
    assert a.usage == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}


def test_sdk_honours_retry_after_ms_and_should_retry(echo_url):
    before, _ = _server_attempts(echo_url, 3)
    user = _serve(echo_url, 3, "sdk", index=31)
    assert [a.status for a in user.attempts] == [503, 503, 200]
    assert user.outcome(CLS) == "good"
    first, second, third = user.attempts
    assert second.sent_s - (first.sent_s + first.e2e_s) >= 0.1   # retry-after-ms: 100
    assert third.sent_s - (second.sent_s + second.e2e_s) >= 0.1
    after, retry_count = _server_attempts(echo_url, 3)
    assert after - before == 3 and retry_count == "2"            # x-stainless-retry-count


def test_sdk_obeys_should_retry_false(echo_url):
    user = _serve(echo_url, 4, "sdk")
    assert [a.status for a in user.attempts] == [429]
    assert user.outcome(CLS) == "error" and "RateLimitError" in user.final_error


def test_sdk_will_not_wait_past_its_retry_after_cap(echo_url):
    user = _serve(echo_url, 5, "sdk")
    assert [a.status for a in user.attempts] == [503]
    assert user.outcome(CLS) == "error"


def test_sdk_backs_off_exponentially_without_headers(echo_url):
    user = _serve(echo_url, 7, "sdk")
    assert [a.status for a in user.attempts] == [503, 503, 503]   # default max_retries = 2
    gaps = [b.sent_s - (a.sent_s + a.e2e_s) for a, b in zip(user.attempts, user.attempts[1:], strict=False)]
    assert gaps[0] >= 0.5 * 0.75 and gaps[1] >= 1.0 * 0.75          # 0.5 s × 2^n, -25 % jitter


def test_sdk_stream_error_event_is_an_explicit_error_not_an_answer(echo_url):
    user = _serve(echo_url, 8, "sdk")
    assert user.num_attempts == 1 and user.answer is None
    assert user.attempts[0].error.startswith("stream error")
    assert user.outcome(CLS) == "error"


def test_sdk_answer_whose_end_lags_done_is_still_its_answer(echo_url):
    """The SDK drains the body after ``[DONE]`` for 0.1 s, then cancels the read: the user
    had the whole answer, and the attempt is not a cancellation."""
    user = _serve(echo_url, 20, "sdk")
    assert user.num_attempts == 1 and user.outcome(CLS) == "good"
    (a,) = user.attempts
    assert a.saw_done and a.num_tokens_received == 4 and a.error is None
    assert a.outcome == "completed"


@pytest.mark.parametrize("kind", ["sdk", "bad_citizen"])
def test_truncated_stream_is_never_an_answer(echo_url, kind):
    user = _serve(echo_url, 2, kind, max_retries=1)
    assert user.answer is None and user.outcome(CLS) == "lost"
    assert all("truncated" in a.error for a in user.attempts)


def test_tenacity_retries_sheds_with_backoff_then_succeeds(echo_url):
    user = _serve(echo_url, 3, "tenacity", index=32, backoff_s=0.05, backoff_max_s=0.2)
    assert [a.status for a in user.attempts] == [503, 503, 200]
    assert user.outcome(CLS) == "good"


def test_tenacity_stops_after_its_retries(echo_url):
    user = _serve(echo_url, 4, "tenacity", max_retries=2, backoff_s=0.01, backoff_max_s=0.02)
    assert [a.status for a in user.attempts] == [429, 429, 429]   # it ignores x-should-retry
    assert user.outcome(CLS) == "error"


def test_bad_citizen_retries_at_once_ignoring_headers(echo_url):
    user = _serve(echo_url, 5, "bad_citizen", max_retries=3)
    assert [a.status for a in user.attempts] == [503] * 4         # retry-after: 200 ignored
    user = _serve(echo_url, 8, "bad_citizen", max_retries=2)
    assert user.num_attempts == 3 and user.outcome(CLS) == "error"


def test_timeout_retry_abandons_hung_attempts(echo_url):
    user = _serve(echo_url, 6, "timeout_retry", attempt_timeout_s=0.3, max_retries=2)
    assert user.num_attempts == 3
    assert all(a.outcome == "canceled" and "timeout" in a.error for a in user.attempts)
    assert user.outcome(CLS) == "lost" and not user.hung


def test_a_client_past_its_own_timeout_is_hung(echo_url):
    """The SDK's timeout is per read: a trickling stream outlives it. The harness cancels the
    client at the drain deadline and calls it hung; an httpx client with a total timeout
    ends on its own and is not."""
    kw = dict(request_class="slow", max_tokens=40, drain_timeout_s=1.5, hang_grace_s=0.2,
              patience_s=0.5)
    sdk = _serve(echo_url, 0, "sdk", **kw)
    assert sdk.hung and sdk.outcome(CLS) == "hung"
    own = _serve(echo_url, 0, "bad_citizen", max_retries=0, **kw)
    assert not own.hung and own.outcome(CLS) == "lost"


def test_a_client_waiting_out_a_retry_after_is_canceled_not_hung(echo_url):
    """At the drain deadline the SDK is asleep on retry-after: 100; the harness cancels it.
    Its user got an explicit 503 in time: an error, not lost, not hung."""
    user = _serve(echo_url, 9, "sdk", drain_timeout_s=0.5, hang_grace_s=0.2)
    assert [a.status for a in user.attempts] == [503]
    assert not user.hung and user.final_error == "canceled at drain deadline"
    assert user.outcome(CLS) == "error"


def test_entry_picker_round_robins_and_refuses_remote_hosts():
    p = EntryPicker(["http://127.0.0.1:1/", "http://127.0.0.1:2"])
    assert [p.next() for _ in range(4)] == ["http://127.0.0.1:1", "http://127.0.0.1:2"] * 2
    with pytest.raises(ValueError, match="non-loopback"):
        EntryPicker(["http://10.0.0.1:8000"])
    with pytest.raises(ValueError):
        EntryPicker([])


def test_entry_picker_leaves_a_refusing_entry_out_for_its_fail_timeout():
    now = [0.0]
    a, b, c = (f"http://127.0.0.1:{p}" for p in (1, 2, 3))
    p = EntryPicker([a, b, c], fail_timeout_s=10.0, clock=lambda: now[0])
    assert p.next() == a
    assert p.connect_failed(b + "/") == c                 # b is out; the connect goes to c
    assert [p.next() for _ in range(4)] == [a, c, a, c]
    now[0] = 9.9
    assert p.next() == a and p.next() == c
    now[0] = 10.0                                         # fail_timeout over: b is tried again
    assert [p.next() for _ in range(3)] == [a, b, c]
    assert p.connect_failed(a) == b and p.connect_failed(b) == c
    assert p.connect_failed(c) is None                    # every entry out: the error goes through
    assert p.next() in (a, b, c)                          # and the round-robin goes on over all
    assert p.summary() == {"connect_failures": {b: 2, a: 1, c: 1}, "failovers": 3,
                           "fail_timeout_s": 10.0}
    with pytest.raises(ValueError, match="not one of the entries"):
        p.connect_failed("http://127.0.0.1:4")
    with pytest.raises(ValueError, match="fail_timeout_s"):
        EntryPicker([a], fail_timeout_s=-1.0)
    assert EntryPicker([a]).connect_failed(a) is None     # one entry: nowhere to go


def _refusing_url() -> str:
    """A loopback port nothing listens on (bound, then closed): connects are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["sdk", "tenacity", "bad_citizen"])
def test_a_dead_entry_costs_the_users_nothing_behind_the_balancer(echo_url, kind):
    """Two entries, one refusing connects (a SIGKILLed proxy): every user's one attempt is
    answered by the other. Without the balancer's failover half of them would see a refused
    connect (the SDK and the others would retry it as a second attempt, or lose the user)."""
    dead = _refusing_url()
    cfg = ClientConfig(kind=kind, patience_s=10.0, backoff_s=0.01, backoff_max_s=0.05)
    run = UserRunConfig(entry_urls=(dead, echo_url), duration_s=0.1, drain_timeout_s=15.0,
                        model="echo")
    specs = [_spec(0, index=i) for i in range(6)]
    result = asyncio.run(run_users(specs, [kind] * 6, {kind: cfg}, run))
    assert [u.num_attempts for u in result.users] == [1] * 6
    assert all(u.outcome(CLS) == "good" for u in result.users)
    assert {u.attempts[0].entry for u in result.users} == {echo_url}  # where it went in the end
    # every refused connect went on to the live entry (the users all start at once, so more
    # than one may reach the dead entry before its first refusal leaves it out)
    refused = result.entries["connect_failures"]
    assert set(refused) == {dead} and refused[dead] == result.entries["failovers"] >= 1


def test_client_config_is_validated():
    with pytest.raises(ValueError, match="kind"):
        ClientConfig(kind="curl", patience_s=1.0)
    with pytest.raises(ValueError, match="attempt_timeout_s"):
        ClientConfig(kind="timeout_retry", patience_s=1.0)
    with pytest.raises(ValueError, match="patience_s"):
        ClientConfig(kind="sdk", patience_s=0.0)
    assert ClientConfig(kind="sdk", patience_s=1.0).retries == 2


def test_client_assignment_is_seeded():
    specs = [_spec(0, i) for i in range(200)]
    a = assign_clients(specs, {"sdk": 3, "bad_citizen": 1}, seed=1)
    assert a == assign_clients(specs, {"sdk": 3, "bad_citizen": 1}, seed=1)
    assert 100 < a.count("sdk") < 190 and set(a) == {"sdk", "bad_citizen"}
