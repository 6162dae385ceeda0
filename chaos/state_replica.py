"""A state-only replica: the sim backend's scheduling and timing without an engine or tokens.

One :class:`StateReplica` keeps what a kvguard engine replica's ``/kvguard/state`` reports —
running and waiting sequences, KV blocks, iteration records — and advances it step by step on
an injected clock (:meth:`StateReplica.advance_to`), each step taking as long as ``step_s``
(the sim backend's roofline, :meth:`engine.timing_model.TimingModel.predict_s`) says, times
``time_scale`` (wall seconds per GPU second, as ``kvguard engine --time-scale``: the steps, and
so every duration the state reports, are ``time_scale`` times longer, and the document says
``time_scale`` so a guard scales its roofline prior to match). Many fit
in one process on one event loop (:mod:`chaos.state_fleet`), where one engine process per
replica would not.

How it schedules, like the engine: every running sequence whose prompt is in decodes one token
per step; the rest of the step's ``max_num_batched_tokens`` goes to prompt chunks, running
sequences first, then waiting ones admitted first come first served while a sequence slot and
the blocks of their chunk are free; the step that finishes a prompt samples its first token; a
sequence grows one block whenever its context crosses a block boundary; it ends at its
``max_tokens`` (the sim's tokens never stop early) and frees its blocks. Where it differs: a
sequence that needs a block when none is free sits the step out (the engine preempts the
newest sequence and recomputes it later), and there is no prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["StateReplica"]

OnTokens = Callable[[int, bool], None]  # (new tokens, finished)


@dataclass(eq=False)  # a sequence is itself: membership tests compare identities, not fields
class _Seq:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    on_tokens: OnTokens
    num_computed_tokens: int = 0  # prompt tokens prefilled so far
    num_output_tokens: int = 0
    num_blocks: int = 0
    aborted: bool = False  # its client left (a step in flight that scheduled it skips it)

    @property
    def num_context_tokens(self) -> int:
        return self.num_computed_tokens + self.num_output_tokens


class StateReplica:
    """One replica's sequences and blocks, advanced by whole engine steps."""

    def __init__(self, step_s: Callable[[int, int, int], float], *, num_total_blocks: int,
                 block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 4096,
                 model: str = "llama-7b", timing_model: dict | None = None,
                 num_iteration_records: int = 64, time_scale: float = 1.0) -> None:
        for key, value in (("num_total_blocks", num_total_blocks), ("block_size", block_size),
                           ("max_num_seqs", max_num_seqs),
                           ("max_num_batched_tokens", max_num_batched_tokens),
                           ("max_model_len", max_model_len),
                           ("num_iteration_records", num_iteration_records)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        if isinstance(time_scale, bool) or not isinstance(time_scale, int | float) or not (
                0 < time_scale < float("inf")):
            raise ValueError(f"time_scale must be a number > 0, got {time_scale!r}")
        self._step_s = step_s
        self.time_scale = float(time_scale)
        self.num_total_blocks = num_total_blocks
        self.num_free_blocks = num_total_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.model = model
        self._timing_model = timing_model
        self._num_iteration_records = num_iteration_records
        self.running: list[_Seq] = []
        self.waiting: list[_Seq] = []
        self.iterations: list[dict] = []
        self.step_count = 0
        self.now_s = 0.0  # the end of the last step applied (or the last idle instant)
        self._in_flight: tuple[float, dict, list] | None = None  # (end, record, effects)

    def submit(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
               on_tokens: OnTokens, now_s: float) -> None:
        """Queue a request arriving at ``now_s``; ValueError when it can never run here."""
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("num_prompt_tokens and max_tokens must be >= 1")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens = {num_prompt_tokens + max_tokens} is over "
                             f"max_model_len {self.max_model_len}")
        if self._in_flight is None and not self.running and not self.waiting:
            self.now_s = max(self.now_s, now_s)  # idle: the next step starts now
        self.waiting.append(_Seq(request_id, num_prompt_tokens, max_tokens, on_tokens))

    def abort(self, request_id: str) -> None:
        """The client left: the sequence goes, its blocks freed (a step in flight that
        scheduled it finishes without it)."""
        for group in (self.running, self.waiting):
            for seq in group:
                if seq.request_id == request_id:
                    group.remove(seq)
                    seq.aborted = True
                    self.num_free_blocks += seq.num_blocks
                    seq.num_blocks = 0
                    return

    @property
    def step_end_s(self) -> float | None:
        """When the step in flight ends (its effects are applied then); None when idle."""
        return None if self._in_flight is None else self._in_flight[0]

    def advance_to(self, now_s: float) -> None:
        """Apply every step that has ended by ``now_s`` and start the next ones."""
        while True:
            if self._in_flight is not None:
                end_s, record, effects = self._in_flight
                if end_s > now_s:
                    return
                self._in_flight = None
                self._apply(end_s, record, effects)
            if not self.running and not self.waiting:
                self.now_s = max(self.now_s, now_s)
                return
            self._start_step()

    def _start_step(self) -> None:
        """Schedule one step at ``now_s``: decodes, then prompt chunks within the budget."""
        budget = self.max_num_batched_tokens
        effects = []  # (seq, prompt tokens, decodes)
        num_decode = num_context = num_prefill = 0
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens or budget < 1:
                continue
            if not self._grow(seq, seq.num_context_tokens + 1):
                continue  # no block for its next token: sits this step out
            effects.append((seq, 0, 1))
            num_decode += 1
            num_context += seq.num_context_tokens
            budget -= 1
        candidates = [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]
        while self.waiting and len(self.running) < self.max_num_seqs:
            candidates.append(self.waiting[0])
            self.running.append(self.waiting.pop(0))
        for seq in candidates:
            if budget < 1:
                break
            chunk = min(budget, seq.num_prompt_tokens - seq.num_computed_tokens)
            if not self._grow(seq, seq.num_computed_tokens + chunk):
                break  # first come first served: nothing overtakes a prompt short of blocks
            effects.append((seq, chunk, 0))
            num_prefill += chunk
            budget -= chunk
        if not effects:  # every sequence waits on a block no step can free: idle a little
            self._in_flight = (self.now_s + 0.001 * self.time_scale, None, [])
            return
        self.step_count += 1
        duration_s = self._step_s(num_prefill, num_decode, num_context) * self.time_scale
        record = {"batch_id": self.step_count, "num_prefill_tokens": num_prefill,
                  "num_decode_seqs": num_decode, "num_context_tokens": num_context,
                  "duration_s": duration_s, "end_s": self.now_s + duration_s}
        self._in_flight = (self.now_s + duration_s, record, effects)

    def _grow(self, seq: _Seq, num_tokens: int) -> bool:
        """Hold the blocks ``num_tokens`` tokens of ``seq`` need; False when none are free."""
        needed = -(-num_tokens // self.block_size) - seq.num_blocks
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        self.num_free_blocks -= needed
        seq.num_blocks += needed
        return True

    def _apply(self, end_s: float, record: dict | None, effects: list) -> None:
        self.now_s = end_s
        if record is not None:
            self.iterations.append(record)
            del self.iterations[:-self._num_iteration_records]
        for seq, chunk, decodes in effects:
            if seq.aborted:  # while the step ran
                continue
            seq.num_computed_tokens += chunk
            new = decodes + (1 if chunk and seq.num_computed_tokens == seq.num_prompt_tokens
                             else 0)
            if not new:
                continue
            seq.num_output_tokens += new
            finished = seq.num_output_tokens >= seq.max_tokens
            if finished:
                self.running.remove(seq)
                self.num_free_blocks += seq.num_blocks
                seq.num_blocks = 0
            seq.on_tokens(new, finished)

    def state(self) -> dict:
        """The ``/kvguard/state`` document (the engine's fields a guard reads)."""
        return {
            "model": self.model, "backend": "state-sim", "max_model_len": self.max_model_len,
            "block_size": self.block_size, "num_total_blocks": self.num_total_blocks,
            "num_free_blocks": self.num_free_blocks, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "num_preemptions": 0,
            "step_count": self.step_count, "now_s": self.now_s,
            "running": [self._seq_state(s) for s in self.running],
            "waiting": [self._seq_state(s) for s in self.waiting],
            "iterations": list(self.iterations),
            "timing_model": self._timing_model, "time_scale": self.time_scale,
        }

    def _seq_state(self, seq: _Seq) -> dict:
        return {"request_id": seq.request_id, "num_prompt_tokens": seq.num_prompt_tokens,
                "num_output_tokens": seq.num_output_tokens, "max_tokens": seq.max_tokens,
                "num_context_tokens": seq.num_context_tokens,
                "num_prefill_tokens_remaining": seq.num_prompt_tokens - seq.num_computed_tokens,
                "num_blocks": seq.num_blocks, "num_cached_tokens": 0, "priority": 0}
