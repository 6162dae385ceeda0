"""``kvguard engine --model tiny`` over real loopback HTTP: OpenAI clients, SSE, disconnects,
validation, metrics, traces. One server subprocess is shared by the module."""

from __future__ import annotations

import asyncio
import json
import random
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import HELPERS_DIR, start_engine, wait_until

from engine.async_engine import AsyncEngine, EngineShutdownError, EngineStepError
from engine.llm_engine import LLMEngine
from engine.openai_request import ApiError, parse_generation_request
from engine.sampling_params import SamplingParams
from engine.server_cli import load_middleware

NUM_BLOCKS = 128
LONG_TOKENS = 900  # a request that would take seconds on the tiny model


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "engine.jsonl"
    args = ["--model", "tiny", "--device", "cpu", "--num-blocks", str(NUM_BLOCKS),
            "--trace", str(trace), "--middleware", "server_helpers:StampMiddleware"]
    with start_engine(args, env={"PYTHONPATH": HELPERS_DIR}) as eng:
        eng.trace_path = trace
        yield eng


@pytest.fixture(scope="module")
def url(engine_server):
    return engine_server.base_url


@pytest.fixture()
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       timeout=30.0) as c:
        yield c


def _state(url: str) -> dict:
    return httpx.get(url + "/kvguard/state", timeout=5.0).json()


def _all_free(url: str) -> dict | None:
    s = _state(url)
    idle = s["num_free_blocks"] == s["num_total_blocks"] and not s["running"] and not s["waiting"]
    return s if idle else None


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=5.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, lbls), v in metrics.items()
               if n == name and all(dict(lbls).get(k) == x for k, x in labels.items()))


def _trace_lines(engine_server) -> list[dict]:
    return [json.loads(line) for line in engine_server.trace_path.read_text().splitlines()]


# ---- OpenAI clients -----------------------------------------------------------------------

def test_openai_completions_non_stream_and_stream(client):
    resp = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 4
    assert resp.usage.total_tokens == 8
    chunks = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=5,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert sum(len(c.choices[0].to_dict()["token_ids"]) for c in token_chunks) == 5
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_openai_chat_non_stream_and_stream(client):
    messages = [{"role": "user", "content": "Say hi"}]
    resp = client.chat.completions.create(model="tiny", messages=messages,
                                          max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                 stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].usage.completion_tokens == 3


def test_request_id_is_echoed_and_traced(url, engine_server):
    resp = httpx.post(url + "/v1/completions", headers={"x-request-id": "trace-me-1"},
                      json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-me-1"
    assert resp.json()["id"] == "cmpl-trace-me-1"
    line = wait_until(lambda: next((t for t in _trace_lines(engine_server)
                                    if t["request_id"] == "trace-me-1"), None), 5.0)
    assert line["finish_reason"] == "length" and line["num_output_tokens"] == 2
    stamps = [line[k] for k in ("arrival_s", "enqueue_s", "prefill_start_s", "first_token_s",
                                "completion_s")]
    assert stamps == sorted(stamps)
    assert len(line["iterations"]) == 2  # one prefill step (samples token 1) + one decode


def test_32_concurrent_streams_get_exact_token_counts(url):
    async def one(aclient, i: int) -> tuple[int, int, str]:
        stream = await aclient.completions.create(
            model="tiny", prompt=[10 + i, 11, 12], max_tokens=6 + i % 3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        num_tokens, usage, reason = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                num_tokens += len(chunk.choices[0].to_dict()["token_ids"])
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return num_tokens, usage, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60.0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert results == [(6 + i % 3, 6 + i % 3, "length") for i in range(32)]
    assert wait_until(lambda: _all_free(url), 10.0)


def test_stop_string_trims_text_and_frees_blocks(client, url):
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=[3, 4, 5], max_tokens=6, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})]
    stop = pieces[2]
    assert stop and stop not in pieces[0] + pieces[1]
    resp = client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=6,
                                     temperature=0.0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == pieces[0] + pieces[1]
    assert resp.choices[0].finish_reason == "stop"
    assert wait_until(lambda: _all_free(url), 10.0)


# ---- disconnects --------------------------------------------------------------------------

def test_disconnect_mid_stream_aborts_and_frees_blocks(url, engine_server):
    before = _metrics(url)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"x-request-id": "gone-mid-stream"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert _state(url)["num_free_blocks"] < NUM_BLOCKS
    assert wait_until(lambda: _all_free(url), 10.0), _state(url)
    after = _metrics(url)
    assert _value(after, "kvguard_engine_requests_aborted_total") == \
        _value(before, "kvguard_engine_requests_aborted_total") + 1
    line = wait_until(lambda: next((t for t in _trace_lines(engine_server)
                                    if t["request_id"] == "gone-mid-stream"), None), 5.0)
    assert line["finish_reason"] == "abort" and line["num_output_tokens"] < LONG_TOKENS


def test_non_streaming_client_that_gives_up_frees_blocks(url, engine_server):
    before = _metrics(url)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": LONG_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=0.5),
                   headers={"x-request-id": "gave-up"})
    assert wait_until(lambda: _all_free(url), 10.0), _state(url)
    assert _value(_metrics(url), "kvguard_engine_requests_aborted_total") == \
        _value(before, "kvguard_engine_requests_aborted_total") + 1
    line = wait_until(lambda: next((t for t in _trace_lines(engine_server)
                                    if t["request_id"] == "gave-up"), None), 5.0)
    assert line["finish_reason"] == "abort" and line["num_output_tokens"] < LONG_TOKENS


# ---- validation ---------------------------------------------------------------------------

_CASES = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"max_tokens": 2}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": 1023}, 400, "max_tokens"),
    ("completions", {"prompt": [1] * 1024, "max_tokens": 1}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 2], "n": 2}, 400, "n"),
    ("completions", {"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": [1, 2], "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": [1, 2], "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": [1, 2], "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": [1, 2], "cache_salt": 5}, 400, "cache_salt"),
    ("completions", {"prompt": [1, 2], "cache_salt": ""}, 400, "cache_salt"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "cache_salt": ["a"]}, 400,
     "cache_salt"),
    ("completions", {"prompt": [1, 10**6]}, 400, None),  # outside the vocabulary (engine check)
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
]


_DEEP = b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}"  # a RecursionError in json.loads

# (endpoint, body, status, param, code): hostile or unsupported input, never a 500
_HOSTILE_CASES = [
    ("completions", _DEEP, 400, None, "invalid_json"),
    ("chat", b'{"messages": [{"role": "user", "content": ' + b"[" * 1100 + b"]" * 1100 + b"}]}",
     400, None, "invalid_json"),
    ("chat", {"messages": [{"role": "assistant"}]}, 400, "messages[0].content", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
                                                             "content": None}]},
     400, "messages[1].content", "invalid_type"),
    ("completions", {"prompt": [1, 2], "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_parameter"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     400, "functions", "unsupported_parameter"),
    ("completions", {"prompt": [1, 2], "logit_bias": {"5": 100}}, 400, "logit_bias",
     "unsupported_parameter"),
    ("completions", b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413, None, "body_too_large"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "code"), _HOSTILE_CASES)
def test_hostile_and_unsupported_input_is_a_clean_4xx(url, endpoint, body, status, param, code):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert "Traceback" not in resp.text
    assert wait_until(lambda: _all_free(url), 10.0)


def test_a_declared_huge_body_is_refused_before_it_is_read(url):
    """100 MB declared, 10 bytes sent: the 413 comes without waiting for (or buffering) the
    rest."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30.0) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 100000000\r\n\r\n"
                     b'{"prompt":')
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")


def test_an_undeclared_body_is_cut_once_it_passes_the_limit():
    """No Content-Length (chunked): the body is read chunk by chunk and refused with 413 as soon
    as it passes the limit, not after buffering the rest."""
    from starlette.requests import Request

    from engine.server import _read_body

    num_received = 0

    async def receive():
        nonlocal num_received
        num_received += 1
        return {"type": "http.request", "body": b"x" * 1000, "more_body": num_received < 10_000}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(ApiError) as info:
        asyncio.run(_read_body(request, 4500))
    assert (info.value.status, info.value.code) == (413, "body_too_large")
    assert num_received == 5  # 5,000 bytes: one chunk past the limit, then stop


def test_neutral_values_of_unsupported_fields_are_accepted(url):
    body = {"prompt": [1, 2], "max_tokens": 2, "best_of": 1, "logit_bias": {}, "tools": [],
            "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u1"}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=30.0)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), _CASES)
def test_validation_errors(url, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"
    assert resp.headers["x-request-id"]


def test_server_keeps_serving_after_bad_requests(url, client):
    for raw in (b"{", b"null", b'{"prompt": [1], "max_tokens": -1}'):
        assert httpx.post(url + "/v1/completions", content=raw).status_code == 400
    assert httpx.get(url + "/health").status_code == 200
    resp = client.completions.create(model="tiny", prompt=[9, 9], max_tokens=2,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=[9], max_tokens=1)


# ---- metrics, state, models ---------------------------------------------------------------

def test_metrics_parse_and_reconcile(url, client):
    assert wait_until(lambda: _all_free(url), 10.0)
    before = _metrics(url)
    for _ in range(3):
        client.completions.create(model="tiny", prompt=[4, 4], max_tokens=2,
                                  extra_body={"ignore_eos": True})
    for _ in range(2):
        httpx.post(url + "/v1/completions", json={"prompt": [], "max_tokens": 2})
    after = _metrics(url)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("kvguard_engine_requests_received_total") == 5
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("kvguard_engine_requests_rejected_total", status="400") == 2
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prompt_tokens_total") == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    received = _value(after, "kvguard_engine_requests_received_total")
    ended = sum(_value(after, n) for n in ("vllm:request_success_total",
                                           "kvguard_engine_requests_rejected_total",
                                           "kvguard_engine_requests_aborted_total",
                                           "kvguard_engine_requests_failed_total"))
    assert received == ended
    labels = {k: v for (n, lbls), _ in after.items() if n == "vllm:cache_config_info"
              for k, v in lbls}
    assert labels == {"block_size": "16", "num_gpu_blocks": str(NUM_BLOCKS),
                      "enable_prefix_caching": "True"}
    assert _value(after, "kvguard_engine_num_total_kv_blocks") == NUM_BLOCKS
    assert _value(after, "kvguard_engine_num_free_kv_blocks") == NUM_BLOCKS
    assert _value(after, "vllm:kv_cache_usage_perc") == 0.0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):
        assert any(n == name for n, _ in after), name


def test_middleware_flag_wraps_the_app(url):
    """The module's server runs with ``--middleware server_helpers:StampMiddleware``; every
    other test here also proves streaming and disconnects work through a middleware."""
    assert httpx.get(url + "/v1/models").headers["x-stamped"] == "1"


@pytest.mark.parametrize("spec", ["no_colon", "engine.nope_module:X", "engine.server:Nope"])
def test_bad_middleware_spec_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="middleware|module"):
        load_middleware(spec)


def test_models_health_and_state(url):
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["alive"] is True
    state = _state(url)
    for key in ("model", "backend", "max_model_len", "block_size", "num_total_blocks",
                "num_free_blocks", "max_num_seqs", "max_num_batched_tokens", "num_preemptions",
                "step_count", "now_s", "running", "waiting", "iterations", "timing_model",
                "time_scale", "admitting", "num_in_flight"):
        assert key in state, key
    assert state["model"] == "tiny" and state["num_total_blocks"] == NUM_BLOCKS
    assert state["admitting"] is True


# ---- prefix cache -------------------------------------------------------------------------

def _unique_prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(num_tokens)]


def _cached_tokens(url: str, prompt: list[int], **extra) -> int:
    resp = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                     "ignore_eos": True, **extra}, timeout=30.0)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_repeated_prompt_reports_cached_tokens_in_usage_metrics_and_state(url, client):
    prompt = _unique_prompt(100, seed=1)  # 6 full blocks of 16 (the 7th is partial)
    assert wait_until(lambda: _all_free(url), 10.0)
    before = _metrics(url)
    assert _cached_tokens(url, prompt) == 0
    assert _cached_tokens(url, prompt) == 96
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 96
    after = _metrics(url)
    delta = lambda name: _value(after, name) - _value(before, name)  # noqa: E731
    assert delta("vllm:prefix_cache_queries_total") == 300
    assert delta("vllm:prefix_cache_hits_total") == 192
    state = wait_until(lambda: _all_free(url), 10.0)
    assert state["enable_prefix_caching"] is True and state["kv_events_endpoint"] is None
    assert state["num_evictable_blocks"] == state["num_cached_blocks"] >= 6
    assert state["block_hash"] == {"version": 1, "model": "tiny"}


def test_cache_salt_isolates_cached_prefixes(url):
    prompt = _unique_prompt(64, seed=2)
    assert _cached_tokens(url, prompt, cache_salt="tenant-a") == 0
    assert _cached_tokens(url, prompt, cache_salt="tenant-a") == 48
    assert _cached_tokens(url, prompt, cache_salt="tenant-b") == 0
    assert _cached_tokens(url, prompt) == 0


def test_running_request_is_listed_in_state_under_its_request_id(url):
    body = {"prompt": [1, 2, 3], "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"x-request-id": "listed-1"}) as resp:
            lines = resp.iter_lines()  # keep it referenced: closing it would disconnect
            assert next(line for line in lines if line.startswith("data: "))
            running = wait_until(lambda: [r for r in _state(url)["running"]
                                          if r["request_id"] == "listed-1"], 5.0)
            assert running and running[0]["num_prompt_tokens"] == 3, json.dumps(_state(url))[:1500]
            assert running[0]["max_tokens"] == LONG_TOKENS
    assert wait_until(lambda: _all_free(url), 10.0)


def test_duplicate_in_flight_request_id_is_409(url):
    body = {"prompt": [1, 2, 3], "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"x-request-id": "twice"}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            dup = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                             headers={"x-request-id": "twice"})
            assert dup.status_code == 409
            assert dup.json()["error"]["code"] == "duplicate_request_id"
    assert wait_until(lambda: _all_free(url), 10.0)


class _WordTokenizer:
    """One token per character: enough to exercise request parsing without a vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize(("max_pool_tokens", "expected"), [(None, 1000), (600, 600), (4096, 1000)])
def test_chat_default_max_tokens_fills_context_capped_by_the_pool(max_pool_tokens, expected):
    raw = json.dumps({"messages": [{"role": "user", "content": "hey"}]}).encode()
    gen = parse_generation_request(raw, chat=True, model_name="m", tokenizer=_WordTokenizer(),
                                   max_model_len=1000, max_pool_tokens=max_pool_tokens)
    num_prompt = len("<user>hey<assistant>")
    assert gen.prompt_token_ids == tuple(_WordTokenizer().encode("<user>hey<assistant>"))
    assert gen.params.max_tokens == expected - num_prompt


def test_completions_request_fields_reach_sampling_params():
    raw = json.dumps({"prompt": [1, 2], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                      "top_k": -1, "seed": 3, "stop": "x", "ignore_eos": True, "priority": 2,
                      "stream": True, "stream_options": {"include_usage": True}}).encode()
    gen = parse_generation_request(raw, chat=False, model_name="m", tokenizer=None,
                                   max_model_len=100)
    assert gen.params == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=None,
                                        seed=3, ignore_eos=True)
    assert (gen.stop, gen.priority, gen.stream, gen.include_usage) == (("x",), 2, True, True)
    with pytest.raises(ApiError, match="no tokenizer"):
        parse_generation_request(b'{"prompt": "text"}', chat=False, model_name="m",
                                 tokenizer=None, max_model_len=100)


# ---- the engine loop itself (in-process) --------------------------------------------------

class _FailOnce:
    """Wraps a runner; the first step that schedules ``poison`` raises."""

    def __init__(self, runner, poison: str) -> None:
        self._runner, self._poison, self.failed = runner, poison, False

    def execute(self, scheduler_output):
        ids = {s.request_id for s in scheduler_output.scheduled}
        if self._poison in ids and not self.failed:
            self.failed = True
            raise RuntimeError("injected step failure")
        return self._runner.execute(scheduler_output)


def test_step_exception_fails_requests_but_loop_keeps_serving():
    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=32)
    engine.runner = _FailOnce(engine.runner, "poison")

    async def main():
        aeng = AsyncEngine(engine)
        aeng.start()
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        bad = await aeng.add_request("poison", [1, 2, 3], params)
        with pytest.raises(EngineStepError):
            async for _ in bad:
                pass
        good = await aeng.add_request("after", [1, 2, 3], params)
        outs = [o async for o in good]
        health = aeng.health()
        await aeng.shutdown(timeout_s=5.0)
        return outs, health

    outs, health = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert health["ok"] and health["alive"]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_shutdown_aborts_what_does_not_finish_in_time():
    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=128)

    async def main():
        aeng = AsyncEngine(engine)
        assert not aeng.health()["ok"]  # no loop yet
        aeng.start()
        assert aeng.health()["ok"]
        stream = await aeng.add_request("long", [1, 2], SamplingParams(max_tokens=1000,
                                                                       ignore_eos=True))
        num_aborted = await aeng.shutdown(timeout_s=0.2)
        outs = [o async for o in stream]
        with pytest.raises(EngineShutdownError):
            await aeng.add_request("late", [1], SamplingParams(max_tokens=1))
        assert not aeng.health()["ok"]
        return num_aborted, outs

    num_aborted, outs = asyncio.run(main())
    assert num_aborted == 1 and outs[-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.num_total_blocks


# ---- the real model -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_serves_chat_and_completions_to_the_openai_client():
    with start_engine(["--model", "smollm2-135m", "--device", "cpu", "--num-blocks", "64"],
                      timeout_s=180.0) as eng:
        with openai.OpenAI(base_url=eng.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=60.0) as client:
            chat = client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "What is 2+2?"}],
                max_tokens=8, temperature=0.0)
            assert chat.choices[0].message.content.strip()
            assert 1 <= chat.usage.completion_tokens <= 8
            chunks = list(client.completions.create(model="smollm2-135m",
                                                    prompt="The capital of France is",
                                                    max_tokens=4, temperature=0.0, stream=True,
                                                    extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].text for c in chunks)
            assert len(chunks) == 4 and text.strip()


def test_request_id_can_be_reused_right_after_an_abort():
    """The engine reports an abort on its next step; that late report must not end a new
    request that reuses the id (a client retrying with the same x-request-id)."""
    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=64)

    async def main():
        aeng = AsyncEngine(engine)
        aeng.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        first = await aeng.add_request("same", [1, 2], params)
        await first.__anext__()
        first.abort()
        assert [o.finish_reason async for o in first][-1] == "abort"
        second = await aeng.add_request("same", [1, 2], SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))
        outs = [o async for o in second]
        await aeng.shutdown(timeout_s=5.0)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 4
