"""guard.request.pricing: body limit, validation, token counting, class/deadline/retry, online learning."""

import asyncio
import json
import math

import pytest

from guard.config import GuardConfig, TenantConfig
from guard.errors import BodyTooLarge, ClientDisconnected, PricingError
from guard.request.body import headers_from_scope, read_body
from guard.request.pricing import (
    Pricer,
    tokenizer_counter,
)

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
ANON = GuardConfig().anonymous_tenant
CHOOSER = TenantConfig("acme", "a" * 64, default_class="interactive", may_choose_class=True)
FIXED = TenantConfig("fixed", "b" * 64, default_class="batch", may_choose_class=False)


def price(pricer, body, path=COMP, headers=None, tenant=ANON, now_s=100.0, max_model_len=4096,
          block_size=16):
    return pricer.price(body, path, headers or {}, tenant, now_s, max_model_len=max_model_len,
                        block_size=block_size, request_id="req-1")


def raises(pricer, body, reason, path=COMP, status=400, **kw):
    with pytest.raises(PricingError) as info:
        price(pricer, body, path, **kw)
    assert info.value.status == status and info.value.reason == reason
    return info.value


# --- read_body --------------------------------------------------------------------------------


class Chunks:
    """An ASGI receive() that serves fixed chunks and counts calls."""

    def __init__(self, chunks, disconnect_at=None):
        self.chunks = chunks
        self.calls = 0
        self.disconnect_at = disconnect_at

    async def __call__(self):
        i = self.calls
        self.calls += 1
        if i == self.disconnect_at:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self.chunks[i],
                "more_body": i < len(self.chunks) - 1}


def test_read_body_joins_chunks():
    receive = Chunks([b"ab", b"", b"cd"])
    assert asyncio.run(read_body(receive, 10)) == b"abcd"
    assert receive.calls == 3


def test_read_body_stops_as_soon_as_the_limit_is_passed():
    receive = Chunks([b"x" * 40] * 100)
    with pytest.raises(BodyTooLarge) as info:
        asyncio.run(read_body(receive, 100))
    assert receive.calls == 3  # 40, 80, 120 > 100: the other 97 chunks are never read
    assert info.value.status == 413 and info.value.reason == "body_too_large"


def test_read_body_refuses_declared_content_length_without_reading():
    receive = Chunks([b"x"])
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receive, 100, content_length=101))
    assert receive.calls == 0
    assert asyncio.run(read_body(Chunks([b"x" * 100]), 100, content_length=100)) == b"x" * 100


def test_read_body_disconnect():
    with pytest.raises(ClientDisconnected):
        asyncio.run(read_body(Chunks([b"a", b"b"], disconnect_at=1), 100))


def test_headers_from_scope_lowercases():
    scope = {"headers": [(b"X-KVGuard-Class", b"batch"), (b"authorization", b"Bearer k")]}
    assert headers_from_scope(scope) == {"x-kvguard-class": "batch", "authorization": "Bearer k"}


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"\xff\xfe", "invalid_json", None),
        (b"[1, 2]", "invalid_json", None),
        ({"model": "m"}, "missing_required_parameter", "prompt"),
        ({"prompt": 12}, "invalid_type", "prompt"),
        ({"prompt": []}, "invalid_value", "prompt"),
        ({"prompt": ["a", "b"]}, "unsupported_value", "prompt"),
        ({"prompt": [1, -2]}, "invalid_type", "prompt"),
        ({"prompt": [1, True]}, "invalid_type", "prompt"),
        ({"prompt": [3, 2.0]}, "invalid_type", "prompt"),
        ({"prompt": [3, None]}, "invalid_type", "prompt"),
        (b'{"prompt": [7, 8, -1]}', "invalid_type", "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"prompt": "hi", "max_tokens": "10"}, "invalid_type", "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1.5}, "invalid_type", "max_tokens"),
        ({"prompt": "", "max_tokens": 3}, "invalid_value", "prompt"),
        ({"prompt": "hi", "stream": "yes"}, "invalid_type", "stream"),
        ({"prompt": "hi", "n": 0}, "invalid_value", "n"),
        ({"prompt": "hi", "temperature": "hot"}, "invalid_type", "temperature"),
        ({"prompt": "hi", "temperature": 3}, "invalid_value", "temperature"),
        ({"prompt": "hi", "model": 7}, "invalid_type", "model"),
    ],
)
def test_completions_validation(body, reason, param):
    err = raises(Pricer(GuardConfig()), body, reason)
    assert err.param == param


@pytest.mark.parametrize(
    ("body", "reason", "param"),
    [
        ({}, "missing_required_parameter", "messages"),
        ({"messages": []}, "invalid_type", "messages"),
        ({"messages": "hello"}, "invalid_type", "messages"),
        ({"messages": ["hello"]}, "invalid_type", "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_type", "messages[0].role"),
        ({"messages": [{"role": "function", "content": "x"}]}, "invalid_type", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "invalid_type", "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "invalid_type",
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
         "invalid_type", "messages[0].content"),
    ],
)
def test_chat_validation(body, reason, param):
    err = raises(Pricer(GuardConfig()), body, reason, path=CHAT)
    assert err.param == param


def test_unknown_path_is_not_priced():
    raises(Pricer(GuardConfig()), {"prompt": "x"}, "unknown_endpoint", path="/v1/audio/speech",
           status=404)


# --- counting and blocks -----------------------------------------------------------------------


def test_token_id_prompt_is_exact_and_blocks_are_worst_case():
    cost = price(Pricer(GuardConfig()), {"prompt": list(range(100)), "max_tokens": 29})
    assert cost.num_prompt_tokens == 100 and cost.max_tokens == 29
    assert cost.num_blocks == math.ceil(129 / 16) == 9
    assert cost.request_id == "req-1" and cost.tenant == "anonymous"
    assert cost.num_expected_output_tokens == 29  # min(max_tokens, default 128)


def test_text_prompt_estimate_uses_chars_per_token():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    assert price(pricer, {"prompt": "x" * 401, "max_tokens": 10}).num_prompt_tokens == 101
    assert price(pricer, {"prompt": ["x" * 8], "max_tokens": 10}).num_prompt_tokens == 2
    assert price(pricer, json.dumps({"prompt": [[1, 2, 3]]}).encode()).num_prompt_tokens == 3


def test_injected_tokenizer_counts_text():
    pricer = Pricer(GuardConfig(), tokenizer=lambda text: len(text.split()))
    priced = pricer.price_request({"prompt": "one two three", "max_tokens": 5}, COMP, {}, ANON,
                                  0.0, max_model_len=100, block_size=4)
    assert priced.cost.num_prompt_tokens == 3 and priced.is_exact


def test_tokenizer_counter_from_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    count = tokenizer_counter(str(path))
    assert count("hello world hello") == 3 and count("") == 0


def test_chat_counts_content_plus_template_overhead():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    body = {"messages": [{"role": "system", "content": "x" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 40},
                                                      {"type": "image_url", "image_url": {}}]},
                         {"role": "assistant", "content": None}],
            "max_completion_tokens": 7, "stream": True}
    priced = pricer.price_request(body, CHAT, {}, ANON, 0.0, max_model_len=4096, block_size=16)
    assert priced.num_prompt_chars == 80 and priced.num_overhead_tokens == 3 * 4 + 3
    assert priced.cost.num_prompt_tokens == 20 + 15
    assert priced.cost.max_tokens == 7 and priced.is_stream and not priced.max_tokens_defaulted


def test_missing_max_tokens_uses_default_and_fits_the_context():
    pricer = Pricer(GuardConfig(default_max_tokens=256))
    priced = pricer.price_request({"prompt": [1] * 100}, COMP, {}, ANON, 0.0, max_model_len=4096,
                                  block_size=16)
    assert priced.cost.max_tokens == 256 and priced.max_tokens_defaulted
    near_full = price(pricer, {"prompt": [1] * 4000}, max_model_len=4096)
    assert near_full.max_tokens == 96  # what is left of the context, not a 400


def test_n_multiplies_blocks_and_expected_output():
    cost = price(Pricer(GuardConfig()), {"prompt": [1] * 16, "max_tokens": 16, "n": 3})
    assert cost.num_blocks == 3 * 2 and cost.num_expected_output_tokens == 3 * 16


def test_context_overflow_is_400_never_retry():
    pricer = Pricer(GuardConfig())
    err = raises(pricer, {"prompt": [1] * 4000, "max_tokens": 97}, "context_length_exceeded")
    assert "4096" in err.message and err.param == "max_tokens"
    assert price(pricer, {"prompt": [1] * 4000, "max_tokens": 96}).max_tokens == 96
    raises(pricer, {"prompt": [1] * 5000}, "context_length_exceeded")  # even with no max_tokens
    # no known context (black-box upstream): no check
    assert price(pricer, {"prompt": [1] * 5000, "max_tokens": 9}, max_model_len=None).max_tokens == 9


def test_estimated_prompt_gets_a_tolerance_before_overflow():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    # about 1000 tokens estimated; rejected only when 90 % of it plus max_tokens overflows
    assert price(pricer, {"prompt": "x" * 4000, "max_tokens": 100}, max_model_len=1000)
    raises(pricer, {"prompt": "x" * 4000, "max_tokens": 101}, "context_length_exceeded",
           max_model_len=1000)


# --- class, deadline, retry --------------------------------------------------------------------


def test_class_header_honoured_only_when_tenant_may_choose():
    pricer = Pricer(GuardConfig())
    h = {"x-kvguard-class": "batch"}
    assert price(pricer, {"prompt": "x"}, headers=h, tenant=CHOOSER).request_class.name == "batch"
    assert price(pricer, {"prompt": "x"}, tenant=CHOOSER).request_class.name == "interactive"
    assert price(pricer, {"prompt": "x"}, headers=h, tenant=ANON).request_class.name == "interactive"
    fixed = price(pricer, {"prompt": "x"}, headers={"x-kvguard-class": "interactive"}, tenant=FIXED)
    assert fixed.request_class.name == "batch"
    err = raises(pricer, {"prompt": "x"}, "unknown_class", headers={"x-kvguard-class": "gold"},
                 tenant=CHOOSER)
    assert err.param == "x-kvguard-class"


def test_deadline_from_class_and_client_headers():
    pricer = Pricer(GuardConfig())
    assert price(pricer, {"prompt": "x"}, now_s=10.0).deadline_s == pytest.approx(11.0)
    assert price(pricer, {"prompt": "x"}, tenant=FIXED, now_s=10.0).deadline_s == pytest.approx(40.0)
    sdk = {"x-stainless-read-timeout": "0.25"}
    assert price(pricer, {"prompt": "x"}, headers=sdk, now_s=10.0).deadline_s == pytest.approx(10.25)
    late = {"x-stainless-read-timeout": "600"}  # later than the class TTFT: the class wins
    assert price(pricer, {"prompt": "x"}, headers=late, now_s=10.0).deadline_s == pytest.approx(11.0)
    ours = {"x-kvguard-deadline-ms": "300", "x-stainless-read-timeout": "0.5"}
    assert price(pricer, {"prompt": "x"}, headers=ours, now_s=10.0).deadline_s == pytest.approx(10.3)
    junk = {"x-stainless-read-timeout": "soon"}
    assert price(pricer, {"prompt": "x"}, headers=junk, now_s=10.0).deadline_s == pytest.approx(11.0)
    for bad in ("soon", "-5", "0", "nan"):
        raises(pricer, {"prompt": "x"}, "invalid_header", headers={"x-kvguard-deadline-ms": bad})


def test_retry_from_sdk_counter_and_repeated_idempotency_key():
    pricer = Pricer(GuardConfig())
    assert not price(pricer, {"prompt": "x"}).is_retry
    assert not price(pricer, {"prompt": "x"}, headers={"x-stainless-retry-count": "0"}).is_retry
    assert price(pricer, {"prompt": "x"}, headers={"x-stainless-retry-count": "2"}).is_retry
    assert price(pricer, {"prompt": "x"}, headers={"x-envoy-attempt-count": "2"}).is_retry
    key = {"idempotency-key": "abc"}
    assert not price(pricer, {"prompt": "x"}, headers=key, now_s=0.0).is_retry
    assert price(pricer, {"prompt": "x"}, headers=key, now_s=5.0).is_retry
    assert not price(pricer, {"prompt": "x"}, headers=key, tenant=CHOOSER, now_s=6.0).is_retry
    # after the TTL the key is forgotten
    assert not price(pricer, {"prompt": "x"}, headers=key, now_s=5.0 + 601.0).is_retry


# --- learning ----------------------------------------------------------------------------------


def test_chars_per_token_calibrates_toward_the_true_ratio():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    for _ in range(300):
        pricer.observe_usage(num_prompt_chars=2500, num_prompt_tokens=1000)  # true ratio 2.5
    assert pricer.chars_per_token == pytest.approx(2.5, rel=0.02)
    assert price(pricer, {"prompt": "x" * 250, "max_tokens": 1}).num_prompt_tokens == 100
    for _ in range(2000):
        pricer.observe_usage(100, 1)  # absurd upstream counts stay bounded
    assert pricer.chars_per_token == 8.0
    pricer.observe_usage(0, 10)
    pricer.observe_usage(10, 0)  # ignored, no division by zero
    assert pricer.chars_per_token == 8.0


def test_observe_completion_subtracts_chat_overhead_and_skips_exact_counts():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    body = {"messages": [{"role": "user", "content": "z" * 300}], "max_tokens": 4}
    priced = pricer.price_request(body, CHAT, {}, ANON, 0.0, max_model_len=4096, block_size=16)
    for _ in range(300):  # true text ratio 3.0: 100 text tokens + 7 overhead tokens
        pricer.observe_completion(priced, num_prompt_tokens=107, num_output_tokens=None)
    assert pricer.chars_per_token == pytest.approx(3.0, rel=0.02)
    exact = pricer.price_request({"prompt": [1, 2], "max_tokens": 4}, COMP, {}, ANON, 0.0,
                                 max_model_len=4096, block_size=16)
    pricer.observe_completion(exact, num_prompt_tokens=2, num_output_tokens=None)
    assert pricer.chars_per_token == pytest.approx(3.0, rel=0.02)


def test_expected_output_is_max_tokens_until_learned_per_class():
    pricer = Pricer(GuardConfig())
    assert pricer.expected_output_tokens("interactive", 1000) == 1000  # worst case first
    assert pricer.expected_output_tokens("interactive", 50) == 50
    for _ in range(7):
        pricer.observe_output("interactive", 40)
    assert pricer.expected_output_tokens("interactive", 1000) == 1000  # not learned yet
    pricer.observe_output("interactive", 40)
    assert pricer.expected_output_tokens("interactive", 1000) == 40
    assert pricer.expected_output_tokens("interactive", 30) == 30  # never above max_tokens
    assert pricer.expected_output_tokens("batch", 1000) == 1000  # per class
    for _ in range(200):
        pricer.observe_output("interactive", 300)  # drift is tracked
    assert pricer.expected_output_tokens("interactive", 1000) == pytest.approx(300, abs=5)
    assert price(pricer, {"prompt": "x", "max_tokens": 1000}).num_expected_output_tokens > 290


def test_preemptions_send_every_class_back_to_max_tokens():
    pricer = Pricer(GuardConfig())
    for _ in range(8):
        pricer.observe_output("interactive", 40)
    assert pricer.expected_output_tokens("interactive", 1000) == 40
    pricer.observe_preemptions(0)
    assert pricer.expected_output_tokens("interactive", 1000) == 40
    pricer.observe_preemptions(3)  # the estimate was too low: worst case again
    assert pricer.expected_output_tokens("interactive", 1000) == 1000
    for _ in range(8):
        pricer.observe_output("interactive", 200)
    assert 40 < pricer.expected_output_tokens("interactive", 1000) <= 200


def test_requests_that_run_to_their_max_tokens_are_priced_at_their_own():
    """A completion that used its whole max_tokens would have gone on: a lower bound, not a
    length. Requests asking 16-64 tokens that all run to the end are each priced at their own
    max_tokens, not at the ~40 mean of what was observed (the old learner's answer)."""
    pricer = Pricer(GuardConfig())
    for max_tokens in (16, 32, 48, 64) * 4:
        pricer.observe_output("interactive", max_tokens, max_tokens)
    assert pricer.expected_output_tokens("interactive", 64) == 64
    assert pricer.expected_output_tokens("interactive", 16) == 16
    assert pricer.expected_output_tokens("interactive", 1000) == 1000  # no sign they stop
    cost = price(pricer, {"prompt": "x", "max_tokens": 60, "n": 2})
    assert cost.num_expected_output_tokens == 2 * 60


def test_natural_stops_and_capped_completions_together():
    """Half stop on their own at 100 tokens, half ran into a 50-token cap: the capped ones say
    only "more than 50", so a request allowed 200 tokens is priced at 100 (the mean of what
    was seen, 75, would price it short)."""
    pricer = Pricer(GuardConfig())
    for _ in range(8):
        pricer.observe_output("interactive", 100, 400)
        pricer.observe_output("interactive", 50, 50)
    assert pricer.expected_output_tokens("interactive", 200) == 100
    assert pricer.expected_output_tokens("interactive", 60) == 60


def test_abandoned_streams_count_as_at_least_what_they_produced():
    """Under overload slow streams are abandoned and only short requests finish. 8 stopped at
    20 tokens, 8 were left after 30: half of the class is known to run past 30, so a request
    allowed 100 tokens is priced at 20 + 0.5 x 80 = 60, not at the 20 the finished ones say."""
    pricer = Pricer(GuardConfig())
    priced = pricer.price_request(json.dumps({"prompt": "x", "max_tokens": 100}).encode(), COMP,
                                  {}, ANON, 0.0, max_model_len=4096, block_size=16)
    for _ in range(8):
        pricer.observe_completion(priced, None, 20)
        pricer.observe_abandoned(priced, 30)
    assert pricer.expected_output_tokens("interactive", 100) == 60
    assert pricer.expected_output_tokens("interactive", 25) == 20 + round(0.5 * 5)


def test_the_learned_table_follows_the_latest_endings():
    """Only the latest endings count (the window), and the table is rebuilt as they come."""
    pricer = Pricer(GuardConfig())
    for _ in range(300):
        pricer.observe_output("interactive", 40, 1000)
    assert pricer.expected_output_tokens("interactive", 1000) == 40
    for i in range(200):
        pricer.observe_output("interactive", 300, 1000)
        if i % 3 == 0:
            pricer.expected_output_tokens("interactive", 1000)  # priced between endings
    assert pricer.expected_output_tokens("interactive", 1000) == 300


@pytest.mark.parametrize("depth", [65, 1100, 100_000])
def test_deep_json_is_a_400_not_a_recursion_error(depth):
    raw = b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    with pytest.raises(PricingError) as info:
        Pricer(GuardConfig()).price_request(raw, COMP, {}, ANON, 0.0, max_model_len=4096,
                                            block_size=16)
    assert (info.value.status, info.value.reason) == (400, "invalid_json")


def test_the_survival_table_is_rebuilt_on_count_or_age_not_per_request():
    """Pricing reads the table; it is rebuilt after REBUILD_EVERY new endings, or after any
    new ending once REBUILD_AFTER_S has passed, so a busy class does not pay a rebuild per
    request."""
    from guard.request.output_lengths import REBUILD_AFTER_S, REBUILD_EVERY, OutputLengths

    lengths = OutputLengths()
    for _ in range(64):
        lengths.observe(40, False)
    assert lengths.expected(1000, now_s=0.0) == 40
    for _ in range(REBUILD_EVERY - 1):
        lengths.observe(1000, True)
    assert lengths.expected(1000, now_s=0.1) == 40  # stale, but neither old nor many enough
    with_long = lengths.expected(1000, now_s=REBUILD_AFTER_S)  # old enough: rebuilt
    assert with_long > 40
    for _ in range(REBUILD_EVERY):
        lengths.observe(5, False)
    assert lengths.expected(1000, now_s=REBUILD_AFTER_S) < with_long  # many enough: at once


def test_an_ending_with_its_time_rebuilds_a_due_table_there_not_in_the_next_lookup(monkeypatch):
    """At low load nearly every ending is due (REBUILD_AFTER_S apart): the guard's release
    rebuilds the table with the ending (``now_s``), so the next request's lookup, on its way to
    the decision, finds it built; an ending that is not due yet waits for the lookup's own
    schedule as before."""
    from guard.request.output_lengths import REBUILD_AFTER_S, OutputLengths

    lengths = OutputLengths()
    for _ in range(64):
        lengths.observe(40, False)
    assert lengths.expected(1000, now_s=0.0) == 40
    real = OutputLengths._rebuild
    builds: list[float] = []
    monkeypatch.setattr(OutputLengths, "_rebuild", lambda self: (builds.append(1), real(self)))
    lengths.observe(1000, True, now_s=1.0)  # due (1 s since the build): rebuilt right here
    assert builds == [1]
    assert lengths.expected(1000, now_s=1.01) > 40 and builds == [1]  # the lookup builds nothing
    lengths.observe(5, False, now_s=1.1)  # 0.1 s after that build: not due
    assert builds == [1]
    lengths.expected(1000, now_s=1.2)
    assert builds == [1]
    lengths.expected(1000, now_s=1.0 + REBUILD_AFTER_S)  # the lookup's schedule: due now
    assert builds == [1, 1]


def test_the_pricer_hands_the_ending_time_on_to_the_class_table():
    """``observe_completion(..., now_s)`` (what the release calls) rebuilds a due table there."""
    pricer = Pricer(GuardConfig())
    priced = pricer.price_request(json.dumps({"prompt": "x", "max_tokens": 100}).encode(), COMP,
                                  {}, ANON, 0.0, max_model_len=4096, block_size=16)
    for i in range(20):
        pricer.observe_completion(priced, None, 20, now_s=float(i))
    learned = pricer._outputs["interactive"]
    assert learned._stale == 0 and learned._built_s == 19.0


# --- embeddings: priced by their input tokens ------------------------------------------------
EMB = "/v1/embeddings"


@pytest.mark.parametrize(("body", "num_tokens"), [
    ({"input": [1, 2, 3]}, 3),
    ({"input": [[1, 2], [3, 4, 5]]}, 5),
    ({"input": "abcdefgh"}, 2),            # 4 chars per token before calibration
    ({"input": ["abcd", "abcdefgh"]}, 3),
])
def test_embeddings_are_priced_by_their_input(body, num_tokens):
    cost = price(Pricer(GuardConfig()), {"model": "e", **body}, path=EMB)
    assert (cost.num_prompt_tokens, cost.max_tokens) == (num_tokens, 1)
    assert cost.num_blocks == -(-(num_tokens + 1) // 16)


def test_an_embedding_body_is_forwarded_as_sent():
    body = b'{"model": "e", "input": "hello"}'
    priced = Pricer(GuardConfig()).price_request(body, EMB, {}, ANON, 0.0)
    assert not priced.max_tokens_defaulted and priced.forward_body() == body


@pytest.mark.parametrize("value", [None, [], 3, [1, "a"], [[1], "a", {}], [True]])
def test_a_bad_embedding_input_is_a_400(value):
    raises(Pricer(GuardConfig()), {"model": "e", "input": value}, "invalid_value", path=EMB)


# --- /v1/responses ----------------------------------------------------------------------------

RESP = "/v1/responses"


def test_responses_input_string_or_items_and_instructions_are_priced():
    pricer = Pricer(GuardConfig(initial_chars_per_token=4.0))
    priced = pricer.price_request({"input": "x" * 40, "instructions": "y" * 40,
                                   "max_output_tokens": 9, "stream": True},
                                  RESP, {}, ANON, 0.0, max_model_len=4096, block_size=16)
    assert priced.num_prompt_chars == 80 and priced.num_overhead_tokens == 4 + 3
    assert priced.cost.num_prompt_tokens == 20 + 7
    assert priced.cost.max_tokens == 9 and priced.is_stream and priced.responses
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a" * 40},
                                          {"type": "input_image", "image_url": "u"}]},
             {"type": "message", "role": "assistant", "content": "b" * 40},
             {"type": "function_call_output", "call_id": "c", "output": "c" * 40}]
    priced = pricer.price_request({"input": items, "max_output_tokens": 5}, RESP, {}, ANON, 0.0,
                                  max_model_len=4096, block_size=16)
    image_chars = len(json.dumps({"type": "input_image", "image_url": "u"}))
    assert priced.num_prompt_chars == 120 + image_chars
    assert priced.num_overhead_tokens == 3 * 4 + 3


def test_responses_max_output_tokens_is_checked_filled_and_forwarded_under_its_name():
    pricer = Pricer(GuardConfig(default_max_tokens=64))
    err = raises(pricer, {"input": "hi", "max_output_tokens": 4096}, "context_length_exceeded",
                 path=RESP)
    assert err.param == "max_output_tokens"
    raises(pricer, {"input": "hi", "max_output_tokens": 0}, "invalid_value", path=RESP)
    raises(pricer, {"max_output_tokens": 3}, "missing_required_parameter", path=RESP)
    raises(pricer, {"input": [3]}, "invalid_type", path=RESP)
    raises(pricer, {"input": "hi", "instructions": 5}, "invalid_type", path=RESP)
    priced = pricer.price_request({"input": "hi", "max_tokens": 2}, RESP, {}, ANON, 0.0,
                                  max_model_len=4096, block_size=16)
    assert priced.cost.max_tokens == 64 and priced.max_tokens_defaulted  # max_tokens: not its name
    forwarded = json.loads(priced.forward_body())
    assert forwarded["max_output_tokens"] == 64 and forwarded["max_tokens"] == 2
