"""Token ids → the text pieces a client sees, with OpenAI ``stop`` strings applied.

``TextStream.push(new_token_ids, finished)`` returns one ``TextPiece`` per engine output. With
stop strings, text that could still turn into a stop string is held back; when one appears,
the text is cut before it and the piece says ``finish_reason="stop"`` (the caller then aborts
the sequence). Without a tokenizer (a token-id-only replica) the text is empty and clients
count ``token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.tokenizer import IncrementalDetokenizer

__all__ = ["TextPiece", "TextStream"]


@dataclass(frozen=True)
class TextPiece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None

    def with_finish_reason(self, finish_reason: str | None) -> TextPiece:
        return replace(self, finish_reason=finish_reason)


class TextStream:
    """Incremental detokenization plus stop-string matching for one request."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet sent

    def push(self, token_ids: Sequence[int], finished: bool) -> TextPiece:
        ids = tuple(token_ids)
        if self._detok is None:
            return TextPiece("", ids)
        self._pending += self._decode(ids)
        if finished:
            self._pending += self._detok.flush()
        cut = self._find_stop()
        if cut is not None:
            text, self._pending = self._pending[:cut], ""
            return TextPiece(text, ids, "stop")
        keep = 0 if finished else min(self._holdback, len(self._pending))
        text = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(text):]
        return TextPiece(text, ids)

    def _decode(self, ids: tuple[int, ...]) -> str:
        try:
            return self._detok.add_many(ids)
        except ValueError:  # an id outside the tokenizer's vocabulary (e.g. a sim model)
            return ""

    def _find_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
