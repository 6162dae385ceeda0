"""A minimal ``tokenizer.json`` for the guard's ``tokenizer`` key, for tests whose requests send
token ids (the precise prefix view needs the key set; the file's vocabulary is never used)."""

from __future__ import annotations

from pathlib import Path


def word_level_tokenizer(directory: Path) -> str:
    """Write a two-word WordLevel tokenizer to ``directory/tokenizer.json``; its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return str(path)
