"""The compact form of ``/kvguard/state`` (``GET /kvguard/state?compact=1``).

The full document lists every running and waiting sequence as an object with eight named
fields; at 256 running sequences that is ~55 kB per poll, most of it repeated key names, and
most of a reader's time goes to building those objects. The compact form carries the same
top-level fields but each sequence group as columns — ``running_columns`` /
``waiting_columns``, one list per field a guard reads (:data:`SEQUENCE_COLUMNS`), the i-th
entry of every list describing the i-th sequence — and, with ``since_batch=N``, only the
iteration samples with ``batch_id`` above ``N`` (those the reader has not seen yet). A reader
that asked for nothing gets the full document; the compact one converts back to it exactly
(:func:`expand_compact_state`, the reference the guard's tests compare against).
"""

from __future__ import annotations

from typing import Any

from serving.state_delta import SEQUENCE_COLUMNS  # the per-sequence fields a guard reads

__all__ = ["SEQUENCE_COLUMNS", "compact_state", "expand_compact_state"]


def compact_state(state: dict[str, Any], since_batch: int | None = None) -> dict[str, Any]:
    """``state`` (the full document) with its sequence groups as columns and, given
    ``since_batch``, only the iterations after it."""
    compact = {k: v for k, v in state.items() if k not in ("running", "waiting")}
    for group in ("running", "waiting"):
        seqs = state[group]
        compact[f"{group}_columns"] = {name: [s[name] for s in seqs] for name in SEQUENCE_COLUMNS}
    if since_batch is not None:
        compact["iterations"] = [it for it in state.get("iterations") or ()
                                 if it["batch_id"] > since_batch]
    return compact


def expand_compact_state(compact: dict[str, Any]) -> dict[str, Any]:
    """The full document's sequence lists back from a compact one (only the columns' fields)."""
    state = {k: v for k, v in compact.items()
             if k not in ("running_columns", "waiting_columns")}
    for group in ("running", "waiting"):
        columns = compact[f"{group}_columns"]
        state[group] = [dict(zip(SEQUENCE_COLUMNS, values, strict=True))
                        for values in zip(*(columns[n] for n in SEQUENCE_COLUMNS), strict=True)]
    return state
