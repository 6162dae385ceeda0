"""guard.request.target: which path admission decides on, and what the proxy forwards."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.config import GuardConfig
from guard.errors import PricingError
from guard.request.target import INVALID_TARGET, Target, is_request_target, read_target

IS_ADMITTED = GuardConfig().is_admitted_path


@pytest.mark.parametrize("raw_path, query, path, raw, admitted", [
    (b"/v1/chat/completions", b"", "/v1/chat/completions", "/v1/chat/completions", True),
    (b"/v1/completions", b"api-version=2", "/v1/completions", "/v1/completions?api-version=2",
     True),
    (b"/openai/v1/completions", b"", "/openai/v1/completions", "/openai/v1/completions", True),
    (b"/v1/chat/%63ompletions", b"", "/v1/chat/completions", "/v1/chat/%63ompletions", True),
    (b"/v1/models", b"", "/v1/models", "/v1/models", False),
    (b"/files/a%2Fb", b"", "/files/a/b", "/files/a%2Fb", False),  # no admitted reading
    (b"/v1/./models", b"", "/v1/./models", "/v1/./models", False),
    (b"/v1/completions", b"q=%3F/x?y", "/v1/completions", "/v1/completions?q=%3F/x?y", True),
    (b"/a.b/v1/completions", b"", "/a.b/v1/completions", "/a.b/v1/completions", True),
])
def test_a_target_is_priced_decoded_and_forwarded_as_sent(raw_path, query, path, raw, admitted):
    assert read_target(raw_path, query, IS_ADMITTED) == Target(path, raw, admitted)


@pytest.mark.parametrize("raw_path", [
    b"/v1/completions%3F/v1/chat/completions",
    b"/v1/completions%3f/v1/chat/completions",
    b"/v1/completions%23/v1/chat/completions",
    b"/v1/chat/completions%3Fx",
    b"/x%2Fv1/completions",
    b"/v1%2fcompletions",
    b"/v1/chat/completions/../../completions",  # a normalising replica would run /v1/completions
    b"/v1/chat/completions/%2E%2E/%2e%2e/completions",
    b"/v1/x/../chat/completions",
])
def test_a_target_with_more_than_one_admitted_reading_is_refused(raw_path):
    refusal = read_target(raw_path, b"", IS_ADMITTED)
    assert isinstance(refusal, PricingError)
    assert refusal.status == 400 and refusal.reason == INVALID_TARGET


@pytest.mark.parametrize("raw_path, query", [
    ("/v1/chät/completions".encode(), b""),
    (b"/v1/chat/completions\xff", b""),
    (b"/v1/chat/completions", "q=ü".encode()),
    (b"/v1/chat completions", b""),
    (b"/v1/chat/completions\x00", b""),
    (b"/v1/chat/completions#frag", b""),
    (b"/v1/chat/completions%zz", b""),
    (b"/v1/chat/completions%4", b""),
    (b"/v1\\chat/completions", b""),
    (b"v1/chat/completions", b""),
    (b"", b""),
    (b"*", b""),
    (b"http://h/v1/chat/completions", b""),
    (b"/v1/chat/completions", b"a#b"),
    (b"/v1/chat/completions", b"a{b}"),
])
def test_a_target_outside_the_grammar_is_refused(raw_path, query):
    refusal = read_target(raw_path, query, IS_ADMITTED)
    assert isinstance(refusal, PricingError) and refusal.status == 400


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=20))
def test_any_bytes_give_a_target_or_a_400_never_an_error(raw_path, query):
    result = read_target(raw_path, query, IS_ADMITTED)
    if isinstance(result, PricingError):
        assert result.status == 400
    else:
        assert is_request_target(result.raw.encode("ascii"))
        assert result.raw.split("?", 1)[0].encode() == raw_path


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["v1", "chat", "completions", "%2F", "%3F", "%23", "%2e", ".",
                                 "..", "a", "%3f", "%2f"]), max_size=8))
def test_an_admitted_target_reads_the_same_every_way(segments):
    raw_path = ("/" + "/".join(segments)).encode()
    result = read_target(raw_path, b"", IS_ADMITTED)
    if isinstance(result, Target) and result.admitted:
        assert "%2" not in raw_path.decode().upper().replace("%2E", "")  # no hidden separator
        assert "/./" not in result.path + "/" and "/../" not in result.path + "/"
        assert result.raw == raw_path.decode()
