"""guard.request.rules.parse_body: orjson first, the stdlib for what strict JSON refuses, so
the guard accepts and refuses exactly the bodies ``json.loads`` does."""

from __future__ import annotations

import json

import pytest

from guard.errors import PricingError
from guard.request.rules import parse_body

ACCEPTED = [
    b'{"model": "m", "prompt": "hi", "max_tokens": 8, "stream": true}',
    b'{"temperature": NaN, "top_p": Infinity}',  # the stdlib's extension: accepted before too
    b'{"seed": 123456789012345678901234567890}',  # past 64 bits: orjson refuses, json does not
    b'{"prompt": "\\ud800 lone surrogate"}',  # a lone surrogate escape
    b'{"a": 1, "a": 2}',  # duplicate keys: the last wins in both
    '{"prompt": "h\u00e9llo"}'.encode("utf-16"),  # a BOM and UTF-16: json.loads sniffs it
    b'  {"x": [1.5, -0.0, 1e400]}  ',
]
REFUSED = [b"", b"{", b"[1, 2]", b'"text"', b"{'single': 1}", b'{"a": 1,}', b"\xff\xfe\xfa",
           b'{"a": 1} trailing']


@pytest.mark.parametrize("body", ACCEPTED)
def test_parse_body_accepts_what_json_loads_accepts_with_the_same_value(body):
    parsed = parse_body(body)
    assert json.dumps(parsed, sort_keys=True) == json.dumps(json.loads(body), sort_keys=True)


@pytest.mark.parametrize("body", REFUSED)
def test_parse_body_refuses_what_is_not_a_json_object(body):
    with pytest.raises(PricingError) as refused:
        parse_body(body)
    assert refused.value.status == 400 and refused.value.reason == "invalid_json"


def test_content_length_junk_is_undeclared_never_an_error():
    from guard.request.body import content_length

    assert content_length({"content-length": "42"}) == 42
    assert content_length({"content-length": "9" * 5000}) is None  # past int()'s digit limit
    assert content_length({"content-length": "\u00b2"}) is None  # isdigit() but not a number
    assert content_length({}) is None
