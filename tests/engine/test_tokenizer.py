"""The GGUF-built tokenizer reproduces SmolLM2's reference tokenizer exactly; streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.gguf_loader import ModelFileNotFoundError, find_smollm2_gguf
from engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    byte_to_unicode_map,
    load_smollm2_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
VECTORS_PATH = REPO_ROOT.parent / "shared" / "data" / "smollm2_tokenizer_vectors.json"

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    try:
        return load_smollm2_tokenizer()
    except ModelFileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def vectors() -> dict:
    if not VECTORS_PATH.is_file():
        pytest.skip(f"reference vectors {VECTORS_PATH} are absent (they live outside the repo)")
    return json.loads(VECTORS_PATH.read_text())


def test_from_gguf_builds_the_same_tokenizer_and_the_loader_caches_it(tokenizer):
    assert load_smollm2_tokenizer() is tokenizer
    fresh = Tokenizer.from_gguf(find_smollm2_gguf())
    assert fresh is not tokenizer and fresh.encode("Hello, world!") == [19556, 28, 905, 17]


def test_vectors_file_has_cases(vectors):
    assert len(vectors["encode"]) >= 10 and vectors["chat"]["ids"]


def test_encode_matches_every_reference_vector(tokenizer, vectors):
    mismatches = [(case["text"], tokenizer.encode(case["text"]), case["ids"])
                  for case in vectors["encode"] if tokenizer.encode(case["text"]) != case["ids"]]
    assert mismatches == []


def test_decode_inverts_encode(tokenizer, vectors):
    for case in vectors["encode"]:
        assert tokenizer.decode(case["ids"]) == case["text"]


def test_chat_template_renders_and_encodes_like_the_reference(tokenizer, vectors):
    chat = vectors["chat"]
    rendered = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert rendered == chat["rendered"]
    assert tokenizer.encode(rendered) == chat["ids"]


def test_chat_template_without_generation_prompt_and_with_system(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_special_tokens_and_ids(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("<|endoftext|>") == [0]
    assert tokenizer.special_token_ids == frozenset(range(17))
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # no BOS
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([49152])


def test_chat_template_raise_exception_is_a_value_error():
    tok = Tokenizer(tokens=["a", "b"], merges=[], token_types=[1, 3], bos_token_id=None,
                    eos_token_id=1, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_is_sandboxed():
    tok = Tokenizer(tokens=["a", "b"], merges=[], token_types=[1, 3], bos_token_id=None,
                    eos_token_id=1, chat_template="{{ messages.__class__.__mro__ }}")
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        tok.apply_chat_template([])


def test_byte_table_is_a_bijection():
    table = byte_to_unicode_map()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


@pytest.mark.parametrize("text", ["ÅÄÖ日本語テキスト 🙂", "naïve café 東京テキスト", "a🙂🙂b ÅÄ\n"])
def test_incremental_detokenizer_never_emits_partial_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # some token of these texts carries only part of a character: a delta is held back
    held_back = [i for i in ids if not _is_complete_utf8(tokenizer.token_bytes(i))]
    assert held_back, "test text should split a multi-byte character across tokens"
    assert "" in deltas


def test_incremental_detokenizer_streams_emoji_byte_by_byte(tokenizer):
    # a 4-byte emoji spelled with single-byte tokens: nothing until the last byte arrives
    byte_ids = [tokenizer.token_to_id(byte_to_unicode_map()[b]) for b in "🙂".encode()]
    assert [tokenizer.token_bytes(i) for i in byte_ids] == [bytes([b]) for b in "🙂".encode()]
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in byte_ids] == ["", "", "", "🙂"]
    assert detok.flush() == ""


def test_incremental_detokenizer_skips_special_tokens_and_flushes_incomplete(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    first_byte = tokenizer.token_to_id(byte_to_unicode_map()["🙂".encode()[0]])
    assert detok.add_many([*tokenizer.encode("ok"), 2, first_byte]) == "ok"
    assert detok.flush() == "\ufffd"  # the stream ended inside a character
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert keep.add_many(tokenizer.encode("<|im_end|>x")) == "<|im_end|>x"


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
