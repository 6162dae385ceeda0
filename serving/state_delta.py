"""``GET /kvguard/state/stream``: the compact state once, then only what changed.

One long-lived response (``text/event-stream``); every ``interval_ms`` (default 100, 10–5000)
one event ``data: {json}``, the first at once, the second ``phase`` (a fraction of the
interval, default 0, in [0, 1)) of an interval late, so that the streams a guard opens at once
need not send in step: ``?interval_ms=100&phase=0.618``. ``iterations=columns`` asks for the
iteration samples as columns (``{"batch_id": [...], "duration_s": [...], ...}``, one list per
field, the i-th entries one sample), the default ``iterations=rows`` for a list of objects:
at 10 Hz a replica stepping every 10 ms sends ten samples an event, most of its bytes, and a
reader takes columns in without a Python step per sample. ``fit=1`` asks for no samples at
all but the replica's fit of its own step time (:mod:`serving.step_time_fit`), as the
document's ``step_time_fit`` field (``fit=0``, the default: the samples). Anything else for
any of the four is a 400; other query parameters are ignored (a reader newer than the
replica: one from before ``fit`` sends the samples, which a guard fits itself).

* ``{"seq": 0, "full": DOC}``: the compact document (``?compact=1``'s form) — always
  the first event of a stream;
* ``{"seq": n, "delta": D}``, ``n`` one more than the event before, with ``D``:

  - ``"set"``: the top-level fields whose value changed (``num_free_blocks``,
    ``step_count``, ``step_time_fit`` after a refit, …; never the sequence groups or the
    iterations);
  - ``"iterations"``: the iteration samples recorded since the event before (rows or
    columns, as asked; the full document's too; none with ``fit=1``);
  - ``"advance"``: ``k`` decode steps: every running sequence that stays running, is not in
    ``running.upsert`` and had no prefill left gained ``k`` output and ``k`` context tokens;
  - ``"running"`` / ``"waiting"``: ``"remove"`` (request ids that left the group),
    ``"upsert"`` (columns, as in the compact document, of the sequences that are new to the
    group or changed otherwise: updated in place, new ones appended) and, only when the
    result's order is not what removing and appending gives, ``"order"`` (every request id
    of the group, in order).

Applying a delta to the document before it gives exactly the compact document of now
(:func:`apply_delta`, the reader's half: the guard's stream source applies it). A reader
that sees a ``seq`` other than the next, or loses the connection, starts a new stream: its
first event is a full document again. A replica that restarts ends its streams with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from typing import Any
from urllib.parse import parse_qs

from serving.step_time_fit import StepTimeFit

__all__ = ["DEFAULT_INTERVAL_MS", "SEQUENCE_COLUMNS", "StateDeltas", "apply_delta",
           "iteration_columns", "serve_state_stream", "spread_phase", "stream_fit",
           "stream_interval_s", "stream_iterations", "stream_phase"]

# the compact document's per-sequence columns (engine.compact_state's), in order
SEQUENCE_COLUMNS = ("request_id", "num_output_tokens", "max_tokens", "num_context_tokens",
                    "num_prefill_tokens_remaining")

DEFAULT_INTERVAL_MS = 100
_GROUPS = ("running", "waiting")
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")  # no sign, exponent, space or "_"
_FIELDS = SEQUENCE_COLUMNS[1:]  # a row: every column but the request id
_OUT, _CTX, _PREFILL = (_FIELDS.index(n) for n in (
    "num_output_tokens", "num_context_tokens", "num_prefill_tokens_remaining"))


def stream_interval_s(value: str | None) -> float:
    """The ``interval_ms`` query value in seconds; ValueError unless 10 ≤ it ≤ 5000."""
    if value is None:
        return DEFAULT_INTERVAL_MS / 1000
    if not value.isdigit() or not 10 <= int(value) <= 5000:
        raise ValueError(f"interval_ms: an integer from 10 to 5000, got {value!r}")
    return int(value) / 1000


def stream_phase(value: str | None, default: float = 0.0) -> float:
    """The ``phase`` query value (a fraction of the interval); ``default`` when absent;
    ValueError unless it is a plain decimal number (``0.25``, ``.5``, ``0``) in [0, 1)."""
    if value is None:
        return default
    if not _DECIMAL.fullmatch(value) or float(value) >= 1.0:
        raise ValueError(f"phase: a decimal fraction of the interval, at least 0 and below 1 "
                         f"(e.g. 0.25), got {value!r}")
    return float(value)


def stream_iterations(value: str | None) -> str:
    """The ``iterations`` query value: ``"rows"`` (the default) or ``"columns"``; ValueError
    for anything else."""
    if value is None:
        return "rows"
    if value not in ("rows", "columns"):
        raise ValueError(f"iterations: 'rows' or 'columns', got {value!r}")
    return value


def stream_fit(value: str | None) -> bool:
    """The ``fit`` query value: ``"1"`` (the replica's fit, no samples) or ``"0"`` (the
    default: the samples); ValueError for anything else."""
    if value is None or value == "0":
        return False
    if value != "1":
        raise ValueError(f"fit: '0' or '1', got {value!r}")
    return True


def iteration_columns(records: list[dict[str, Any]]) -> dict[str, list] | list:
    """Iteration samples (objects with the same fields, as an engine records them) as
    columns: one list per field, in the first sample's field order. Samples whose fields
    differ stay the list they were (a reader takes either form)."""
    if not records:
        return records
    fields = records[0].keys()
    if any(record.keys() != fields for record in records):
        return records
    return {name: [record[name] for record in records] for name in fields}


_GOLDEN = (5 ** 0.5 - 1) / 2  # successive multiples, mod 1, fill [0, 1) evenly for any count


def spread_phase(index: int) -> float:
    """The ``index``-th of a sequence of phases that spreads any number of streams evenly over
    the interval: ``index`` times the golden ratio's fraction, mod 1 (0, 0.618, 0.236, 0.854,
    …; each new one falls in one of the widest gaps the ones before left)."""
    return (index * _GOLDEN) % 1.0


def _rows(columns: dict[str, list]) -> dict[str, tuple]:
    return {values[0]: values[1:]
            for values in zip(*(columns[n] for n in SEQUENCE_COLUMNS), strict=True)}


def _advanced(row: tuple, k: int) -> tuple:
    if not k or row[_PREFILL]:
        return row
    row = list(row)
    row[_OUT] += k
    row[_CTX] += k
    return tuple(row)


class StateDeltas:
    """One stream's encoder: :meth:`event` for each state, in order. With ``fit`` (the
    replica's :class:`~serving.step_time_fit.StepTimeFit`, which may serve other streams too)
    its events carry the replica's ``step_time_fit`` instead of iteration samples."""

    def __init__(self, iterations: str = "rows", fit: StepTimeFit | None = None) -> None:
        self._columns = stream_iterations(iterations) == "columns"
        self._fit = fit
        self.seq = -1
        self._top: dict[str, Any] = {}
        self._groups: dict[str, dict[str, tuple]] = {}
        self._last_batch: int | None = None

    def event(self, compact: dict[str, Any]) -> dict[str, Any]:
        """The next event for ``compact`` (the compact ``/kvguard/state`` document of now,
        every iteration sample it keeps included: those sent already are left out here)."""
        if self._fit is not None:  # the fit of the samples instead of the samples
            fitted = self._fit.update(compact)
            compact = {k: v for k, v in compact.items() if k != "iterations"}
            compact["step_time_fit"] = fitted
        last = self._last_batch
        if last is not None:
            compact = {**compact, "iterations": [
                it for it in compact.get("iterations") or () if it["batch_id"] > last]}
        self.seq += 1
        top = {k: v for k, v in compact.items()
               if k not in ("running_columns", "waiting_columns", "iterations")}
        groups = {g: _rows(compact[f"{g}_columns"]) for g in _GROUPS}
        iterations = compact.get("iterations") or []
        if iterations:
            self._last_batch = max(it["batch_id"] for it in iterations)

        if self._columns and self._fit is None:  # (a fit's events carry no samples)
            iterations = iteration_columns(iterations)
            compact = {**compact, "iterations": iterations}
        if self.seq == 0:
            event = {"seq": 0, "full": compact}
        else:
            delta: dict[str, Any] = {}
            changed = {k: v for k, v in top.items() if self._top.get(k, _MISSING) != v}
            if changed:
                delta["set"] = changed
            if iterations:
                delta["iterations"] = iterations
            k = _advance(self._groups["running"], groups["running"])
            if k:
                delta["advance"] = k
            for group in _GROUPS:
                change = _group_delta(self._groups[group], groups[group],
                                      k if group == "running" else 0)
                if change:
                    delta[group] = change
            event = {"seq": self.seq, "delta": delta}
        self._top, self._groups = top, groups
        return event


_MISSING = object()


def _advance(before: dict[str, tuple], after: dict[str, tuple]) -> int:
    """The decode steps most running sequences advanced by (0: none)."""
    steps = Counter(row[_OUT] - before[rid][_OUT] for rid, row in after.items()
                    if rid in before and not before[rid][_PREFILL])
    if not steps:
        return 0
    k, _ = steps.most_common(1)[0]
    return k if k > 0 else 0


def _group_delta(before: dict[str, tuple], after: dict[str, tuple], k: int) -> dict:
    removed = [rid for rid in before if rid not in after]
    upsert = [rid for rid, row in after.items()
              if rid not in before or _advanced(before[rid], k) != row]
    change: dict[str, Any] = {}
    if removed:
        change["remove"] = removed
    if upsert:
        change["upsert"] = {"request_id": upsert, **{
            name: [after[rid][i] for rid in upsert] for i, name in enumerate(_FIELDS)}}
    kept = [rid for rid in before if rid in after]
    new = [rid for rid in after if rid not in before]
    if kept + new != list(after):
        change["order"] = list(after)
    return change


def apply_delta(compact: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The compact document after ``delta`` (a new one; ``compact`` is left as it was)."""
    out = {k: v for k, v in compact.items() if k not in ("running_columns", "waiting_columns")}
    out.update(delta.get("set", {}))
    iterations = delta.get("iterations", ())
    out["iterations"] = {name: list(values) for name, values in iterations.items()} \
        if isinstance(iterations, dict) else list(iterations)
    k = delta.get("advance", 0)
    for group in _GROUPS:
        rows = _rows(compact[f"{group}_columns"])
        change = delta.get(group, {})
        for rid in change.get("remove", ()):
            del rows[rid]
        upsert = change.get("upsert")
        updated = set(upsert["request_id"]) if upsert else set()
        if group == "running" and k:
            rows = {rid: row if rid in updated else _advanced(row, k) for rid, row in rows.items()}
        if upsert:
            for i, rid in enumerate(upsert["request_id"]):
                rows[rid] = tuple(upsert[name][i] for name in _FIELDS)
        order = change.get("order")
        if order is not None:
            rows = {rid: rows[rid] for rid in order}
        out[f"{group}_columns"] = {"request_id": list(rows), **{
            name: [row[i] for row in rows.values()] for i, name in enumerate(_FIELDS)}}
    return out


async def serve_state_stream(scope: dict, receive: Any, send: Any, compact: Any,
                             serving: Any = None, phase: float = 0.0,
                             fit: StepTimeFit | None = None) -> None:
    """Answer ``GET /kvguard/state/stream[?interval_ms=N][&phase=F][&iterations=columns]
    [&fit=1]`` on ASGI: ``compact()`` (the compact document of now) encoded as events every
    ``interval_ms`` until the client goes away or ``serving()`` (optional) turns false — a
    draining replica ends its streams, so they do not hold its shutdown. A bad
    ``interval_ms``, ``phase``, ``iterations`` or ``fit`` is a 400 (and no stream).
    ``fit=1`` streams carry the replica's ``fit`` (one for all its streams: a fit each
    second, however many guards read it; a stream's own when none is given).

    The phase (a fraction of the interval, in [0, 1)) moves the events after the first that
    much later: the first at once, the second ``1 + phase`` intervals after it, then one every
    interval. Streams a guard opens at once keep in step otherwise. The client's ``phase``
    query value wins; without one the ``phase`` argument holds (default 0): replicas served
    from one event loop (``chaos.state_fleet``) never drift apart, so they pass each its own,
    for guards that ask none (those before the query parameter)."""
    if not 0.0 <= phase < 1.0:
        raise ValueError(f"phase must be in [0, 1), got {phase!r}")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    try:
        interval_s = stream_interval_s((query.get("interval_ms") or [None])[0])
        phase = stream_phase((query.get("phase") or [None])[0], phase)
        iterations = stream_iterations((query.get("iterations") or [None])[0])
        fitted = stream_fit((query.get("fit") or [None])[0])
    except ValueError as exc:
        body = json.dumps({"error": {"message": str(exc),
                                     "type": "invalid_request_error"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    gone = asyncio.ensure_future(_until_disconnect(receive))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache")]})
    encoder = StateDeltas(iterations, (fit or StepTimeFit()) if fitted else None)
    loop = asyncio.get_running_loop()
    gap_s = interval_s * (1.0 + phase)  # after the first event; then every interval
    try:
        while not gone.done() and (serving is None or serving()):
            started_s = loop.time()
            event = json.dumps(encoder.event(compact()), separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(),
                        "more_body": True})
            await asyncio.wait({gone}, timeout=max(0.0, gap_s - (loop.time() - started_s)))
            gap_s = interval_s
    except OSError:  # the client went away mid-write
        pass
    finally:
        gone.cancel()
    with contextlib.suppress(Exception):  # the client is gone: the end may not reach it
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

