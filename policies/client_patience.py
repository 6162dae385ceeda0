"""How long clients wait for an admitted request before they give up, learned per class.

A client that disconnects before its response ends tells the guard its patience: it gave up
``elapsed_s`` (arrival → release) after arriving. Timeout-and-retry clients do this on every
attempt that runs past their per-attempt timeout; each such attempt was replica work thrown
away, and its retry comes straight back as load (the metastable loop of a retry storm).

:class:`ClientPatience` keeps, per request class, the last ``PATIENCE_WINDOW_OUTCOMES``
outcomes of admitted requests within ``PATIENCE_WINDOW_S`` — a completion (any completed
response, within its SLO or not) or a client cancellation. While the window holds at least
``MIN_PATIENCE_OUTCOMES`` outcomes, at least ``MIN_PATIENCE_CANCELS`` cancellations and
cancellations are at least ``min_cancel_share`` of them, the estimate is the
``quantile``-th quantile of elapsed-at-cancel; otherwise there is none. Only a client's own
disconnect counts: a cancellation the guard caused (its task cancelled at shutdown) and every
other outcome (failed, rejected upstream) is left out. The estimate lapses ``PATIENCE_WINDOW_S``
after the last cancellation even when no outcome arrives to roll the window.

The window also gives the decode time per output token that recent streams actually saw
(release − first token, over the tokens after the first): under load, prefill chunks
interleaved with decode make a stream's steps far longer than a decode step alone, and a
patience check that assumed the forecast join step would admit the very requests that are then
abandoned mid-stream. It is the median of the last ``RECENT_DECODE_SAMPLES`` streams, completed
*and* abandoned (an abandoned one's tokens relayed so far; its release is the client's
disconnect, at most a step after its last token): the median over the whole window lagged a
burst by many seconds (quiet-time paces outnumbered the burst's), and completions alone are the
streams short enough to finish — the slow, long ones are the abandoned ones.

Time is the caller's (the guard's clock, in the samples and in :meth:`patience_s`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

__all__ = [
    "ClientPatience",
    "Patience",
    "PATIENCE_WINDOW_OUTCOMES",
    "PATIENCE_WINDOW_S",
    "MIN_PATIENCE_OUTCOMES",
    "MIN_PATIENCE_CANCELS",
    "RECENT_DECODE_SAMPLES",
]

PATIENCE_WINDOW_OUTCOMES = 200  # recent outcomes per class
PATIENCE_WINDOW_S = 30.0  # outcomes older than this leave the window
MIN_PATIENCE_OUTCOMES = 20  # fewer outcomes than this: no estimate
MIN_PATIENCE_CANCELS = 5  # fewer cancellations than this: no estimate
RECENT_DECODE_SAMPLES = 16  # the decode pace is the median of this many latest streams


class Patience(NamedTuple):
    patience_s: float  # arrival → the client gives up
    decode_step_s: float | None  # recent streams' decode time per output token, if known
    # most recent completions used their whole max_tokens: expect a request to run to its own
    runs_to_max_tokens: bool = False


class _ClassWindow:
    __slots__ = ("outcomes", "num_cancels", "estimate", "last_cancel_s")

    def __init__(self) -> None:
        # (released_s, elapsed_s of a cancellation | None, decode s/token of the stream | None,
        #  a completion that used its whole max_tokens | None for a cancellation)
        self.outcomes: deque[tuple[float, float | None, float | None, bool | None]] = deque()
        self.num_cancels = 0
        self.estimate: Patience | None = None
        self.last_cancel_s: float | None = None


class ClientPatience:
    """Per-class estimate of client patience from recent cancellations of admitted requests."""

    def __init__(self, quantile: float = 0.25, min_cancel_share: float = 0.05) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"patience_quantile must be in (0, 1], got {quantile!r}")
        if not 0.0 < min_cancel_share <= 1.0:
            raise ValueError(f"min_cancel_share must be in (0, 1], got {min_cancel_share!r}")
        self.quantile = quantile
        self.min_cancel_share = min_cancel_share
        self._classes: dict[str, _ClassWindow] = {}

    def record(self, class_name: str, now_s: float, elapsed_s: float | None,
               decode_step_s: float | None = None, ran_to_max_tokens: bool | None = None
               ) -> None:
        """One outcome: ``elapsed_s`` is arrival → release of a client cancellation, ``None``
        for a completion; ``decode_step_s``: the stream's decode time per token, if known;
        ``ran_to_max_tokens``: a completion that generated its whole ``max_tokens``."""
        window = self._classes.get(class_name)
        if window is None:
            window = self._classes[class_name] = _ClassWindow()
        outcomes = window.outcomes
        outcomes.append((now_s, elapsed_s, decode_step_s, ran_to_max_tokens))
        if elapsed_s is not None:
            window.num_cancels += 1
            window.last_cancel_s = now_s
        while outcomes and (len(outcomes) > PATIENCE_WINDOW_OUTCOMES
                            or outcomes[0][0] < now_s - PATIENCE_WINDOW_S):
            if outcomes.popleft()[1] is not None:  # a cancellation left the window
                window.num_cancels -= 1
        window.estimate = self._estimate(window)

    def _estimate(self, window: _ClassWindow) -> Patience | None:
        num = len(window.outcomes)
        num_cancels = window.num_cancels
        if (num < MIN_PATIENCE_OUTCOMES or num_cancels < MIN_PATIENCE_CANCELS
                or num_cancels < self.min_cancel_share * num):
            return None
        elapsed = sorted(e for _, e, _, _ in window.outcomes if e is not None)
        patience_s = elapsed[max(0, math.ceil(self.quantile * len(elapsed)) - 1)]  # nearest rank
        steps = []
        capped = completions = 0
        for _, _, step_s, ran_to_max in reversed(window.outcomes):  # the latest streams first
            if step_s is not None and len(steps) < RECENT_DECODE_SAMPLES:
                steps.append(step_s)
            if ran_to_max is not None and completions < RECENT_DECODE_SAMPLES:
                completions += 1
                capped += ran_to_max
            if len(steps) == completions == RECENT_DECODE_SAMPLES:
                break
        steps.sort()
        return Patience(patience_s, steps[len(steps) // 2] if steps else None,
                        completions > 0 and 2 * capped >= completions)

    def estimate(self, class_name: str, now_s: float) -> Patience | None:
        """The class's patience estimate, ``None`` when inactive."""
        window = self._classes.get(class_name)
        if window is None or window.estimate is None:
            return None
        if now_s - window.last_cancel_s > PATIENCE_WINDOW_S:
            return None
        return window.estimate

    def patience_s(self, class_name: str, now_s: float) -> float | None:
        """The class's patience (seconds from arrival), ``None`` when inactive."""
        estimate = self.estimate(class_name, now_s)
        return None if estimate is None else estimate.patience_s

    def active(self, now_s: float) -> dict[str, float]:
        """Every class with an active estimate (for the ``kvguard_client_patience_seconds`` gauge)."""
        estimates = {}
        for name in self._classes:
            value = self.patience_s(name, now_s)
            if value is not None:
                estimates[name] = value
        return estimates
