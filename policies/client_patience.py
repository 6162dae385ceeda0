"""How long clients wait for an admitted request before they give up, learned per client.

A client that disconnects before its response ends tells the guard its patience: it gave up
``elapsed_s`` (arrival → release) after arriving. Timeout-and-retry clients do this on every
attempt that runs past their per-attempt timeout; each such attempt was replica work thrown
away, and its retry comes straight back as load (the metastable loop of a retry storm).

**Per client, not per class.** Clients behind one endpoint differ: an app on the OpenAI SDK
waits up to its 600 s default while a script with a 9 s timeout abandons whatever is slower.
One estimate for the whole class held every client to the impatient ones' limit, so under
load the guard shed requests that patient clients would have received within their SLO and
the replicas ran below capacity (the chaos ``seed`` run: 30 % of users on a timeout-and-retry
client; SDK users' requests were shed as if they would be abandoned). So patience is learned
per *client key*: the request class, the tenant and the client software — the first product
token of the ``User-Agent`` (``OpenAI`` for the OpenAI Python SDK, ``Python`` for aiohttp,
``python-httpx``, ``curl``; see :func:`client_software`). At most ``MAX_CLIENT_KEYS`` keys are
kept (the least recently seen one is dropped first).

:class:`ClientPatience` keeps, per client key, the last ``PATIENCE_WINDOW_OUTCOMES`` outcomes
of its admitted requests within ``PATIENCE_WINDOW_S`` — a completion (any completed response,
within its SLO or not) or a client cancellation. An estimate **starts** once the window holds
at least ``MIN_PATIENCE_OUTCOMES`` outcomes, at least ``MIN_PATIENCE_CANCELS`` cancellations and
cancellations are at least ``min_cancel_share`` of them. Its value is the earliest time by
which a ``quantile`` share of the key's clients have given up, estimated by Kaplan–Meier
(:func:`patience_quantile_s`): a completion after ``elapsed_s`` counts as a client that would
have waited at least that long. A quantile of the cancellations alone was thrown by retries
cut short by their users' overall deadlines (cancelled 0.5–3 s into the attempt): one such
cancellation, alone in the window, made the patience 0.6 s — shorter than any request could
be served in, so the check stood aside and the guard filled the TTFT budget again. Once
started the estimate **holds** until ``PATIENCE_HOLD_S`` after the key's last cancellation,
even when cancellations fall below the share — their falling is what the check achieves, and
dropping it then (as the first version did) let the guard fill the whole TTFT budget again
until the next wave of abandoned requests switched it back on: in the ``seed`` run admissions
swung between ~20/s and ~8/s against 12/s of capacity. While it holds, each newer cancellation
refreshes the value when the window's data still reach the quantile; otherwise the last value
stands.
Only a client's own disconnect counts: a cancellation the guard caused (its task cancelled at
shutdown) and every other outcome (failed, rejected upstream) is left out.

The decode time per output token that recent streams actually saw is a replica property, so it
is kept per class, over every client: release − first token, over the tokens after the first.
Under load, prefill chunks interleaved with decode make a stream's steps far longer than a
decode step alone, and a patience check that assumed the forecast join step would admit the
very requests that are then abandoned mid-stream. It is the median of the last
``RECENT_DECODE_SAMPLES`` streams, completed *and* abandoned (an abandoned one's tokens relayed
so far; its release is the client's disconnect, at most a step after its last token): the
median over a long window lagged a burst by many seconds, and completions alone are the streams
short enough to finish — the slow, long ones are the abandoned ones. Whether most of the latest
completions ran to their ``max_tokens`` is kept per class the same way.

Time is the caller's (the guard's clock, in the samples and in :meth:`estimate`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import NamedTuple

__all__ = [
    "ClientPatience",
    "Patience",
    "client_software",
    "patience_quantile_s",
    "PATIENCE_WINDOW_OUTCOMES",
    "PATIENCE_WINDOW_S",
    "PATIENCE_HOLD_S",
    "MIN_PATIENCE_OUTCOMES",
    "MIN_PATIENCE_CANCELS",
    "RECENT_DECODE_SAMPLES",
    "MAX_CLIENT_KEYS",
]

PATIENCE_WINDOW_OUTCOMES = 200  # recent outcomes per client key
PATIENCE_WINDOW_S = 30.0  # outcomes older than this leave the window
PATIENCE_HOLD_S = 60.0  # a started estimate holds this long after the key's last cancellation
MIN_PATIENCE_OUTCOMES = 20  # fewer outcomes than this: no estimate starts
MIN_PATIENCE_CANCELS = 5  # fewer cancellations than this: no estimate starts
RECENT_DECODE_SAMPLES = 16  # the decode pace is the median of this many latest streams
MAX_CLIENT_KEYS = 256  # client keys kept; the least recently seen is dropped first
MAX_SOFTWARE_CHARS = 32  # a client software name is cut to this


def client_software(user_agent: str | None) -> str:
    """The client software a ``User-Agent`` names: its first product token's name, lower-case,
    at most ``MAX_SOFTWARE_CHARS`` characters (``"OpenAI/Python 1.54.0"`` → ``"openai"``,
    ``"Python/3.12 aiohttp/3.9.5"`` → ``"python"``, ``"curl/8.5.0"`` → ``"curl"``); ``""``
    without one.

    Every request is priced with this, and a service sees few distinct ``User-Agent`` strings:
    the answer is kept per string (up to ``MAX_KNOWN_AGENTS``; then the table starts over), so
    a request costs one dict lookup instead of five string operations."""
    known = _KNOWN_AGENTS.get(user_agent)
    if known is not None:
        return known
    if not user_agent:
        return ""
    software = user_agent.lstrip().split("/", 1)[0].split(" ", 1)[0][:MAX_SOFTWARE_CHARS].lower()
    if len(_KNOWN_AGENTS) >= MAX_KNOWN_AGENTS:
        _KNOWN_AGENTS.clear()  # many distinct agents (or a client making them up): start over
    _KNOWN_AGENTS[user_agent] = software
    return software


MAX_KNOWN_AGENTS = 1024  # User-Agent strings whose client software is kept
_KNOWN_AGENTS: dict[str, str] = {}


class Patience(NamedTuple):
    patience_s: float  # arrival → the client gives up
    decode_step_s: float | None  # recent streams' decode time per output token, if known
    # most recent completions used their whole max_tokens: expect a request to run to its own
    runs_to_max_tokens: bool = False


class _ClientWindow:
    __slots__ = ("outcomes", "num_cancels", "patience_s", "last_cancel_s")

    def __init__(self) -> None:
        # (released_s, elapsed_s (arrival → release) | None if unknown, a client cancellation?)
        self.outcomes: deque[tuple[float, float | None, bool]] = deque()
        self.num_cancels = 0
        self.patience_s: float | None = None  # the started estimate (held, see the module)
        self.last_cancel_s: float | None = None


class _ClassPace:
    """Per class: the latest streams' decode time per token, and whether the latest completions
    ran to their ``max_tokens`` (both read on every decision while an estimate holds: worked
    out once per new outcome, not per read)."""
    __slots__ = ("steps", "capped", "_summary")

    def __init__(self) -> None:
        self.steps: deque[float] = deque(maxlen=RECENT_DECODE_SAMPLES)
        self.capped: deque[bool] = deque(maxlen=RECENT_DECODE_SAMPLES)
        self._summary: tuple[float | None, bool] | None = None  # None: to work out again

    def add(self, decode_step_s: float | None, ran_to_max_tokens: bool | None) -> None:
        if decode_step_s is not None:
            self.steps.append(decode_step_s)
            self._summary = None
        if ran_to_max_tokens is not None:
            self.capped.append(ran_to_max_tokens)
            self._summary = None

    def summary(self) -> tuple[float | None, bool]:
        """(the median decode time per token, most completions ran to their max_tokens)."""
        summary = self._summary
        if summary is None:
            steps = sorted(self.steps)
            capped = self.capped
            summary = self._summary = (steps[len(steps) // 2] if steps else None,
                                       bool(capped) and 2 * sum(capped) >= len(capped))
        return summary


def patience_quantile_s(outcomes: Iterable[tuple[float, float | None, bool]],
                        quantile: float) -> float | None:
    """The earliest time by which at least ``quantile`` of clients have given up, from
    ``(released_s, elapsed_s, canceled)`` outcomes, or ``None`` if the data never get there.

    Kaplan–Meier: a cancellation after ``elapsed_s`` is a client's patience; a completion after
    ``elapsed_s`` says only that its client would have waited at least that long (censored; at
    a tie it counts as still waiting). Completions are what make this robust: a retry cut short
    by its user's overall deadline (a cancellation 0.6 s into the attempt) is one drop among
    every request still running at 0.6 s, not the quarter of the cancellations it would be."""
    times = sorted((e, not c) for _, e, c in outcomes if e is not None)  # cancels first at ties
    at_risk = len(times)
    survival = 1.0
    i = 0
    while i < len(times):
        t = times[i][0]
        num_cancels = num_here = 0
        while i < len(times) and times[i][0] == t:
            num_cancels += not times[i][1]
            num_here += 1
            i += 1
        if num_cancels:
            survival *= 1.0 - num_cancels / at_risk
            if 1.0 - survival >= quantile - 1e-12:
                return t
        at_risk -= num_here
    return None


class ClientPatience:
    """Per-client estimate of patience from recent cancellations of admitted requests."""

    def __init__(self, quantile: float = 0.25, min_cancel_share: float = 0.05) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"patience_quantile must be in (0, 1], got {quantile!r}")
        if not 0.0 < min_cancel_share <= 1.0:
            raise ValueError(f"min_cancel_share must be in (0, 1], got {min_cancel_share!r}")
        self.quantile = quantile
        self.min_cancel_share = min_cancel_share
        self._clients: OrderedDict[tuple[str, str, str], _ClientWindow] = OrderedDict()
        self._paces: dict[str, _ClassPace] = {}

    def record(self, class_name: str, now_s: float, elapsed_s: float | None, canceled: bool,
               decode_step_s: float | None = None, ran_to_max_tokens: bool | None = None,
               tenant: str = "", software: str = "") -> None:
        """One outcome of a request by ``software`` (:func:`client_software`) of ``tenant``: a
        client cancellation (``canceled``) or a completion, ``elapsed_s`` after its arrival
        (``None`` if unknown); ``decode_step_s``: the stream's decode time per token, if known;
        ``ran_to_max_tokens``: a completion that generated its whole ``max_tokens``."""
        pace = self._paces.get(class_name)
        if pace is None:
            pace = self._paces[class_name] = _ClassPace()
        pace.add(decode_step_s, ran_to_max_tokens)
        key = (class_name, tenant, software)
        clients = self._clients
        window = clients.get(key)
        if window is None:
            if len(clients) >= MAX_CLIENT_KEYS:
                clients.popitem(last=False)
            window = clients[key] = _ClientWindow()
        else:
            clients.move_to_end(key)
        outcomes = window.outcomes
        outcomes.append((now_s, elapsed_s, canceled))
        if canceled:
            window.num_cancels += 1
            window.last_cancel_s = now_s
        while outcomes and (len(outcomes) > PATIENCE_WINDOW_OUTCOMES
                            or outcomes[0][0] < now_s - PATIENCE_WINDOW_S):
            if outcomes.popleft()[2]:  # a cancellation left the window
                window.num_cancels -= 1
        if canceled and elapsed_s is not None:
            # only a cancellation can lower the survival curve: completions are not walked
            self._update(window)

    def _update(self, window: _ClientWindow) -> None:
        """Start the estimate (once the share gate opens), or refresh a started one; a started
        estimate is never dropped here (it lapses by time, see :meth:`_patience_s`)."""
        num = len(window.outcomes)
        num_cancels = window.num_cancels
        if window.patience_s is None and (
                num < MIN_PATIENCE_OUTCOMES or num_cancels < MIN_PATIENCE_CANCELS
                or num_cancels < self.min_cancel_share * num):
            return
        patience_s = patience_quantile_s(window.outcomes, self.quantile)
        if patience_s is not None:
            window.patience_s = patience_s

    def _patience_s(self, window: _ClientWindow | None, now_s: float) -> float | None:
        if window is None or window.patience_s is None:
            return None
        if now_s - window.last_cancel_s > PATIENCE_HOLD_S:
            window.patience_s = None  # lapsed: a new estimate must start from the share again
            return None
        return window.patience_s

    def estimate(self, class_name: str, now_s: float, tenant: str = "",
                 software: str = "") -> Patience | None:
        """The client's patience estimate, ``None`` when none holds."""
        window = self._clients.get((class_name, tenant, software))
        if window is None or window.patience_s is None:  # the common case: no call further
            return None
        patience_s = self._patience_s(window, now_s)
        if patience_s is None:
            return None
        return Patience(patience_s, *self._paces[class_name].summary())

    def patience_s(self, class_name: str, now_s: float, tenant: str = "",
                   software: str = "") -> float | None:
        """The client's patience (seconds from arrival), ``None`` when none holds."""
        return self._patience_s(self._clients.get((class_name, tenant, software)), now_s)

    def active(self, now_s: float) -> dict[str, float]:
        """Per class, the shortest patience any of its clients holds (for the
        ``kvguard_client_patience_seconds`` gauge); a class without one is absent."""
        estimates: dict[str, float] = {}
        for (class_name, _, _), window in list(self._clients.items()):
            value = self._patience_s(window, now_s)
            if value is not None and value < estimates.get(class_name, math.inf):
                estimates[class_name] = value
        return estimates
