"""The depth-limited JSON body decoder (pure)."""

import json

import pytest

from serving import json_body
from serving.json_body import JsonBodyError, decode_json_object, loads, nesting_depth_exceeds


@pytest.mark.parametrize(("raw", "max_depth", "exceeds"), [
    (b'{"a": [1, 2]}', 2, False),
    (b'{"a": [[1]]}', 2, True),
    (b'{"a": "[[[[[[[[[[{{{{{{{{"}', 2, False),  # brackets inside strings do not count
    (b'{"a": "\\"[[[[[["}', 1, False),  # nor after an escaped quote
    (b'[{}, {}, {}, {}, {}, []]', 2, False),  # many brackets, little depth
    (b"[" * 65 + b"]" * 65, 64, True),
    (b"[" * 64 + b"]" * 64, 64, False),
])
def test_nesting_depth(raw, max_depth, exceeds):
    assert nesting_depth_exceeds(raw, max_depth) is exceeds


@pytest.mark.parametrize("raw", [
    b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}",  # json.loads alone: RecursionError
    b"[" * 100_000,  # unbalanced and deep
    b"{not json", b"[1, 2]", b"null", b"\xff\xfe\x00", b"",
])
def test_bad_bodies_raise_one_error_type(raw):
    with pytest.raises(JsonBodyError) as info:
        decode_json_object(raw)
    assert info.value.code == "invalid_json" and info.value.message


def test_a_plain_object_decodes():
    assert decode_json_object(b'{"prompt": [1, 2], "x": {"y": "[["}}') == {
        "prompt": [1, 2], "x": {"y": "[["}}


@pytest.mark.parametrize("raw", [
    b'{"n": 123456789012345678, "x": 0.020000999999999998}',  # 18 digits: fits 64 bits
    b'{"n": 1234567890123456789012, "m": -98765432109876543210}',  # past 64 bits
    b'{"x": 0.00012345678901234567, "s": "12345678901234567890"}',  # long runs, not ints
    b'{"duration_s": 0.007123456789012345, "y": [0.00012345678901234567, -0.0012345678901]}',
    b'12345678901234567890',  # a top-level integer past 64 bits
    b'[1.5, 12345678901234567890.25, 1e0000000000000000000005]',
    b'[1e400, NaN, -Infinity]',  # the stdlib's extensions
    "{\"\u00e9\": [1, 2.5, true, null]}".encode(),
])
def test_loads_parses_as_the_stdlib_does(raw):
    """orjson where it parses exactly as ``json.loads``; the stdlib wherever a run of 19 or more
    digits may be an integer past 64 bits (orjson would make it a float) or orjson refuses."""
    got, want = loads(raw), json.loads(raw)
    assert repr(got) == repr(want)
    assert [type(v) for v in _leaves(got)] == [type(v) for v in _leaves(want)]


def _leaves(value):
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@pytest.mark.parametrize("raw, expected", [
    (b'{"prompt": [12, 345678], "n": 9223372036854775807}', 9223372036854775807),
    (b'{"prompt": [1, 2], "n": 123456789012345678901234567890}',
     123456789012345678901234567890),  # past 64 bits: the stdlib keeps it exact
    (b'{"n": -10000000000000000000, "prompt": [0]}', -10000000000000000000),
])
def test_loads_keeps_integers_of_any_length_exact(raw, expected):
    parsed = loads(raw)
    assert parsed["n"] == expected and isinstance(parsed["n"], int)


def test_long_fractions_are_parsed_by_orjson(monkeypatch):
    """A float's fraction runs to 19-20 digits below 0.01 (a step's ``duration_s`` in every
    state delta); it cannot be an integer past 64 bits, so orjson parses it (the stdlib fallback
    is not called); an integer part of 19 digits still goes to the stdlib."""
    calls = []
    monkeypatch.setattr(json_body.json, "loads", lambda raw: calls.append(raw) or "stdlib")
    raw = b'{"iterations": [{"duration_s": 0.007123456789012345, "x": 0.00012345678901234567}]}'
    assert loads(raw) == {"iterations": [{"duration_s": 0.007123456789012345,
                                          "x": 0.00012345678901234567}]}
    assert calls == []
    assert loads(b'{"n": 1234567890123456789}') == "stdlib"
    assert loads(b'1234567890123456789') == "stdlib"
    assert loads(b'{"n": -1234567890123456789.5}') == "stdlib"
