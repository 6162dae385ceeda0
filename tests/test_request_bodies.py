"""One table of request bodies, run against both parsers: the guard's (in front of a kvguard
engine) and the engine's own. They must agree on accept / reject, status and error code for
every row, so the guard never admits (and reserves for) what the engine then refuses.

A row is ``(path, body, status, code)``: ``body`` is the raw bytes, or a dict to JSON-encode;
``status`` 200 means accepted (``code`` None). Add rows freely.
"""

import json

import pytest

from engine.openai_request import ApiError, parse_generation_request
from guard.config import GuardConfig
from guard.errors import PricingError
from guard.request.pricing import Pricer
from guard.request.rules import ReplicaRules

C, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL, MAX_MODEL_LEN = "tiny", 256


def user(content):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


ROWS = [
    (C, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}, 200, None),
    (C, {"prompt": "hello there", "max_tokens": 4, "stream": True}, 200, None),
    (C, {"prompt": [[1, 2]], "max_tokens": 4}, 200, None),
    (C, {"prompt": [1, 2], "max_tokens": 4, "n": 1, "temperature": 0, "top_p": 1}, 200, None),
    (CHAT, user("hi"), 200, None),
    (CHAT, user([{"type": "text", "text": "hi"}]), 200, None),
    (CHAT, {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hi"}]}, 200, None),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}, 200, None),
    (C, {"model": "gpt-9", "prompt": [1], "max_tokens": 2}, 404, "model_not_found"),
    (C, {"model": 7, "prompt": [1], "max_tokens": 2}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 2, "n": 2}, 400, "unsupported_value"),
    (C, {"prompt": [1], "max_tokens": 2, "n": 0}, 400, "unsupported_value"),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, 400, "invalid_type"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_type"),
    (CHAT, {"messages": ["hello"]}, 400, "invalid_type"),
    (CHAT, user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400,
     "invalid_type"),
    (CHAT, user([{"type": "text", "text": 1}]), 400, "invalid_type"),
    (CHAT, user(5), 400, "invalid_type"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_type"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None}]}, 400, "invalid_type"),
    (CHAT, {"model": MODEL}, 400, "missing_required_parameter"),
    (CHAT, {"messages": []}, 400, "invalid_type"),
    (C, b'{"prompt": "hi", ', 400, "invalid_json"),
    (C, b"[1, 2, 3]", 400, "invalid_json"),
    (C, {"model": MODEL, "max_tokens": 4}, 400, "missing_required_parameter"),
    (C, {"prompt": [], "max_tokens": 4}, 400, "invalid_value"),
    (C, {"prompt": "", "max_tokens": 4}, 400, "invalid_value"),
    (C, {"prompt": 12, "max_tokens": 4}, 400, "invalid_type"),
    (C, {"prompt": ["a", "b"], "max_tokens": 4}, 400, "unsupported_value"),
    (C, {"prompt": [1, -2], "max_tokens": 4}, 400, "invalid_type"),
    (C, {"prompt": [1, True], "max_tokens": 4}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 0}, 400, "invalid_value"),
    (C, {"prompt": [1], "max_tokens": "10"}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 1.5}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 4, "stream": "yes"}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 4, "temperature": 3}, 400, "invalid_value"),
    (C, {"prompt": [1], "max_tokens": 4, "temperature": "hot"}, 400, "invalid_type"),
    (C, {"prompt": [1], "max_tokens": 4, "top_p": 1.5}, 400, "invalid_value"),
    (C, {"prompt": [1] * 250, "max_tokens": 10}, 400, "context_length_exceeded"),
    # the reliability battery's two 500s: a RecursionError in json, a TypeError in the template
    (C, b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}", 400, "invalid_json"),
    (C, b'{"prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}", 400, "invalid_json"),
    (CHAT, {"messages": [{"role": "assistant"}]}, 400, "invalid_type"),
    # fields a kvguard engine cannot honour: refused unless neutral
    (C, {"prompt": [1], "max_tokens": 2, "best_of": 2}, 400, "unsupported_parameter"),
    (C, {"prompt": [1], "max_tokens": 2, "best_of": 1, "logit_bias": {}}, 200, None),
    (CHAT, {**user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "unsupported_parameter"),
    (CHAT, {**user("hi"), "functions": [{"name": "f"}]}, 400, "unsupported_parameter"),
    (CHAT, {**user("hi"), "response_format": {"type": "json_object"}}, 400,
     "unsupported_parameter"),
    (C, {"prompt": [1], "max_tokens": 2, "presence_penalty": 0.5}, 400, "unsupported_parameter"),
]


class ByteTokenizer:
    """One token per UTF-8 byte; a plain chat template. Enough for the parsers' checks."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def engine_answer(path: str, raw: bytes) -> tuple[int, str | None]:
    try:
        parse_generation_request(raw, chat=path == CHAT, model_name=MODEL,
                                 tokenizer=ByteTokenizer(), max_model_len=MAX_MODEL_LEN)
    except ApiError as error:
        return error.status, error.code
    return 200, None


def guard_answer(path: str, raw: bytes) -> tuple[int, str | None]:
    config = GuardConfig()
    rules = ReplicaRules(MAX_MODEL_LEN, 16, frozenset({MODEL}), strict=True)
    try:
        Pricer(config).price_request(raw, path, {}, config.anonymous_tenant, 0.0, rules=rules)
    except PricingError as error:
        return error.status, error.reason
    return 200, None


@pytest.mark.parametrize(("path", "body", "status", "code"), ROWS,
                         ids=[f"{i}-{r[2]}-{r[3]}" for i, r in enumerate(ROWS)])
def test_guard_and_engine_agree(path, body, status, code):
    raw = _raw(body)
    assert engine_answer(path, raw) == (status, code)
    assert guard_answer(path, raw) == (status, code)
