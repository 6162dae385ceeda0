"""How many tokens a request of a class will generate, learned from the ones that ended.

Most endings do not tell a request's natural length. A completion that used all of its
``max_tokens`` (``finish_reason: "length"``) would have gone on; a stream the client left after
``k`` tokens would have produced at least ``k``. Both are *censored* observations: the length
is known only to be at least that much. A plain mean of what was observed is biased short
whenever lengths are capped: a class whose requests all run to their ``max_tokens`` of 16–64
learns a mean of ~40, and a request asking for 64 is then priced at 40. The bias grows where
it hurts most, under overload, when slow streams are abandoned and only the short ones finish.

:class:`OutputLengths` keeps the latest ``WINDOW`` endings of a class and prices a request by
the Kaplan–Meier estimate of the length distribution, which counts a censored ending as "at
least this long" instead of as a length::

    E[min(T, max_tokens)] = sum over j = 0 .. max_tokens - 1 of P(T > j)

so a class whose requests all run to their cap prices each request at its own ``max_tokens``,
and one whose requests stop on their own prices them at the mean length (capped). Beyond the
longest ending seen, the estimate keeps its last survival value (no evidence that lengths stop
there). The table behind the sum is a pass over the class's endings, so it is rebuilt when a lookup finds
``REBUILD_EVERY`` new endings, or any new ending and ``REBUILD_AFTER_S`` since the last build,
or while the class has few endings — never per request under load; a lookup is one bisection.
An ending observed with its time (the guard's release) rebuilds a table that is due right
there, after the response went out, so a lookup on a request's way to its decision rarely
builds one (only for endings that came within ``REBUILD_AFTER_S`` of a build).
"""

from __future__ import annotations

import bisect
from collections import deque

__all__ = ["OutputLengths", "WINDOW", "REBUILD_EVERY", "REBUILD_AFTER_S"]

WINDOW = 128  # endings kept per class: recent enough to follow drift
REBUILD_EVERY = 32  # new endings that always trigger a rebuild of the survival table
REBUILD_AFTER_S = 0.25  # ... and the age after which any new ending does
_FEW = 16  # below this many endings every new one rebuilds (cheap, and each one counts)


class OutputLengths:
    """One class's recent endings: ``(tokens, censored)``; see the module docstring."""

    __slots__ = ("_endings", "num_fresh", "_stale", "_built_s", "_times", "_survival",
                 "_cumulative")

    def __init__(self) -> None:
        self._endings: deque[tuple[int, bool]] = deque(maxlen=WINDOW)
        self.num_fresh = 0  # endings since the last reset (preemptions)
        self._stale = 0  # endings since the table was built
        self._built_s = float("-inf")
        self._times: list[int] = []  # event times (uncensored lengths), ascending
        self._survival: list[float] = []  # P(T > t) from each event time on
        self._cumulative: list[float] = []  # sum of P(T > j) for j < each event time

    def observe(self, num_tokens: int, censored: bool, now_s: float | None = None) -> None:
        """A request ended after ``num_tokens`` (per choice); ``censored``: it would have gone
        on (hit ``max_tokens``, or the client left). With ``now_s`` the table is rebuilt here
        when the schedule says it is due, so that the next request's lookup, on its way to the
        decision, finds it built (at low load nearly every ending is due: 0.25 s apart)."""
        if num_tokens < 1:
            if censored:
                return  # "at least 0 tokens" says nothing
            num_tokens = 1
        self._endings.append((num_tokens, censored))
        self.num_fresh += 1
        self._stale += 1
        if now_s is not None and self._due(now_s):
            self._rebuild()
            self._built_s = now_s

    def _due(self, now_s: float) -> bool:
        return (self._stale >= REBUILD_EVERY or len(self._endings) <= _FEW
                or now_s - self._built_s >= REBUILD_AFTER_S)

    def reset(self) -> None:
        """Too optimistic (the replica preempted): price at ``max_tokens`` until fresh endings
        come in; what was seen is kept as their start."""
        self.num_fresh = 0

    def expected(self, max_tokens: int, now_s: float | None = None) -> int:
        """E[min(T, max_tokens)], rounded, in [1, max_tokens]. Without ``now_s`` the table is
        brought up to date first; with it, on the schedule in the module docstring."""
        if self._stale and (now_s is None or self._due(now_s)):
            self._rebuild()
            if now_s is not None:
                self._built_s = now_s
        i = bisect.bisect_right(self._times, max_tokens) - 1
        if i < 0:
            total = float(max_tokens)  # no ending before max_tokens: P(T > j) = 1 throughout
        else:
            total = self._cumulative[i] + self._survival[i] * (max_tokens - self._times[i])
        return max(1, min(max_tokens, round(total)))

    def _rebuild(self) -> None:
        endings = sorted(self._endings)
        at_risk = len(endings)
        survival, accumulated, previous_t = 1.0, 0.0, 0
        times, survivals, cumulative = [], [], []
        i, n = 0, len(endings)
        while i < n:
            t = endings[i][0]
            num_events = num_at_t = 0
            while i < n and endings[i][0] == t:
                num_at_t += 1
                num_events += not endings[i][1]
                i += 1
            if num_events:
                accumulated += survival * (t - previous_t)  # P(T > j) for previous_t <= j < t
                survival *= 1.0 - num_events / at_risk
                times.append(t)
                survivals.append(survival)
                cumulative.append(accumulated)
                previous_t = t
            at_risk -= num_at_t  # censored at t were at risk at t, and leave after it
        self._times, self._survival, self._cumulative = times, survivals, cumulative
        self._stale = 0
