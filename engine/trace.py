"""Request trace of one engine replica: one JSON line per finished request.

Every timestamp is the replica's ``time.monotonic()`` in seconds (``*_s``), the clock that
``/kvguard/state`` reports as ``now_s``, so a reader joins traces by request id and compares only
differences. One line looks like::

    {"source": "engine", "request_id": "r1", "arrival_s": 10.0, "enqueue_s": 10.001,
     "prefill_start_s": 10.002, "prefill_end_s": 10.010, "first_token_s": 10.010,
     "first_byte_s": 10.011, "completion_s": 10.5, "finish_reason": "length",
     "num_prompt_tokens": 12, "num_output_tokens": 8, "stream": true,
     "iterations": [[3, 10.010], [4, 10.02], ...],
     "tokens": [[3, 10.002, 10.010, 10.0102, 10.0108], [4, 10.011, 10.02, ...], ...]}

``arrival_s``: the HTTP request reached the replica; ``enqueue_s``: the engine thread added it to
the scheduler; ``prefill_start_s``: first step that scheduled it (the end of the step before);
``prefill_end_s``/``first_token_s``: end of the step that sampled its first token;
``first_byte_s``: the first content chunk was handed to the transport; ``iterations``: each
engine step it took part in as ``[batch_id, step_end_s]``. Missing stages are ``null`` (e.g. a
request aborted while waiting). ``finish_reason`` is ``stop``/``length``/``abort``/``error``.

``tokens`` (streamed requests only; ``null`` otherwise) is the delivery record of every streamed
token, in order: ``[batch_id, step_start_s, step_end_s, handed_s, written_s]`` — the engine step
that produced it and the engine clock around that step, when the event loop handed it to the
response (the response coroutine took it from the engine's hand-off queue), and when the
server's ``send`` of the SSE chunk carrying it returned (the bytes are with the transport; with
the guard mounted in-process this includes the guard's relay). ``written_s`` is ``null`` for a
token whose chunk was never written (the client went away). Recorded only while a trace is
written: with no ``--trace`` the server takes no per-token timestamps.

With ``--step-trace FILE`` the server also writes one line per engine step to FILE: the record
cost accounting shares each step's time by (``chaos.cost``)::

    {"source": "engine_step", "batch_id": 4, "start_s": 10.011, "end_s": 10.02,
     "work": [["r1", 0, 1, 20, 0], ["r2", 16, 0, 0, 0], ...]}

``work`` holds one ``[request_id, prefill_tokens, decode_tokens, kv_read_tokens,
recomputed_tokens]`` per scheduled request (:class:`engine.outputs.RequestWork`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["RequestTimeline", "TOKEN_FIELDS", "TraceWriter", "step_record"]

TOKEN_FIELDS = ("batch_id", "step_start_s", "step_end_s", "handed_s", "written_s")


@dataclass
class RequestTimeline:
    """Mutable per-request timestamps; the engine thread and the server each fill their own."""

    request_id: str
    arrival_s: float
    stream: bool = False
    enqueue_s: float | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    first_token_s: float | None = None
    first_byte_s: float | None = None
    completion_s: float | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    iterations: list[tuple[int, float]] = field(default_factory=list)
    tokens: list[list] | None = None  # per-token delivery records; None: not recorded

    def token_handed(self, output, now_s: float) -> None:
        """Loop thread: the response took ``output`` (a ``RequestOutput``) at ``now_s``."""
        for _ in output.new_token_ids:
            self.tokens.append([output.batch_id, output.step_start_s, output.step_end_s,
                                now_s, None])

    def token_written(self, now_s: float) -> None:
        """Loop thread: the chunk carrying every handed, unwritten token was sent at ``now_s``."""
        for record in reversed(self.tokens):
            if record[4] is not None:
                return
            record[4] = now_s

    @property
    def queue_s(self) -> float | None:
        if self.enqueue_s is None or self.prefill_start_s is None:
            return None
        return max(self.prefill_start_s - self.enqueue_s, 0.0)

    def to_json(self) -> dict:
        return {
            "source": "engine",
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "enqueue_s": self.enqueue_s,
            "prefill_start_s": self.prefill_start_s,
            "prefill_end_s": self.prefill_end_s,
            "first_token_s": self.first_token_s,
            "first_byte_s": self.first_byte_s,
            "completion_s": self.completion_s,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "stream": self.stream,
            "iterations": [list(it) for it in self.iterations],
            "tokens": self.tokens,
        }


def step_record(result) -> dict | None:
    """The ``engine_step`` line of a ``StepResult``; None for a step that ran nothing."""
    if result.iteration is None:
        return None
    return {"source": "engine_step", "batch_id": result.iteration.batch_id,
            "start_s": result.start_s, "end_s": result.iteration.end_s,
            "work": [[w.request_id, w.num_prefill_tokens, w.num_decode_tokens,
                      w.num_kv_read_tokens, w.num_recomputed_tokens] for w in result.work]}


class TraceWriter:
    """Appends one JSON line per request to a text stream and flushes it (thread-safe)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str) -> TraceWriter:
        return cls(open(path, "a", encoding="utf-8"))  # noqa: SIM115 - closed by close()

    def write(self, timeline: RequestTimeline) -> None:
        self.write_line(timeline.to_json())

    def write_step(self, result) -> None:
        """One ``engine_step`` line for a ``StepResult`` (nothing for an empty step)."""
        record = step_record(result)
        if record is not None:
            self.write_line(record)

    def write_line(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def close(self) -> None:
        with self._lock:
            self._out.close()
