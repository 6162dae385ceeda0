"""Per-replica load aggregates, computed once per :class:`ReplicaSnapshot` and cached on it.

A policy decides many times against one snapshot (the guard re-decides every queued request on
each completion and state refresh), so the sums over a replica's sequences are computed once,
lazily, per group: ``running`` and ``waiting`` (what the engine reported, unchanged between
refreshes) and ``reserved`` (the guard's unreported admissions, which change on every admission).
``ReplicaSnapshot.with_reservations`` keeps the engine groups' sums when only the reservations
change, and :meth:`ReplicaLoad.with_reserved` adds a reserved group (whose sums the guard keeps
incrementally) on top of the engine-only load without re-summing anything. The finish schedule
(a sort) is computed only when a request must wait for KV blocks or a sequence slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from policies.seq_load import SeqLoad

__all__ = ["SeqTotals", "ReplicaLoad", "FinishSchedule", "num_blocks_for"]


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks holding ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class FinishSchedule:
    """When the replica's sequences finish and how many blocks they return, soonest first.

    ``num_steps[i]`` is the number of engine steps until the i-th sequence to finish is done;
    ``num_freed_blocks[i]`` the blocks returned by the first ``i + 1`` finishers together.
    """

    num_steps: tuple[int, ...]
    num_freed_blocks: tuple[int, ...]


@dataclass(frozen=True)
class SeqTotals:
    """Sums over one group of sequences (running, waiting or reserved)."""

    seqs: tuple[SeqLoad, ...]
    block_size: int
    chunk_tokens: int  # prefill tokens per step, for the finish estimate
    num_context_tokens: int  # in the KV cache now
    num_prefill_tokens: int  # prompt tokens still to prefill
    num_committed_blocks: int  # blocks the group will still grow into (prompt left + output)
    min_itl_s: float | None  # tightest declared ITL limit

    @classmethod
    def of(cls, seqs: tuple[SeqLoad, ...], block_size: int, chunk_tokens: int) -> SeqTotals:
        num_context = num_prefill = num_committed = 0
        min_itl_s = None
        for s in seqs:  # one pass: this runs once per replica per refresh
            ctx, pre = s.num_context_tokens, s.num_prefill_tokens_remaining
            num_context += ctx
            num_prefill += pre
            final = ctx + pre + s.num_remaining_output_tokens
            num_committed += (ctx + block_size - 1) // block_size - (
                final + block_size - 1
            ) // block_size
            if s.itl_s is not None and (min_itl_s is None or s.itl_s < min_itl_s):
                min_itl_s = s.itl_s
        return cls(
            seqs, block_size, chunk_tokens, num_context, num_prefill, -num_committed, min_itl_s
        )

    @classmethod
    def empty(cls, block_size: int, chunk_tokens: int) -> SeqTotals:
        """The sums over no sequence (equal to ``SeqTotals.of((), ...)``), one shared instance
        per block size and chunk: every state refresh's engine-only snapshot has an empty
        reserved group."""
        key = (block_size, chunk_tokens)
        empty = _EMPTY.get(key)
        if empty is None:
            empty = _EMPTY[key] = cls.of((), block_size, chunk_tokens)
        return empty

    @cached_property
    def ends(self) -> list[tuple[int, int]]:
        """``(steps until finished, final blocks)`` per sequence, sorted."""
        bs, chunk = self.block_size, max(1, self.chunk_tokens)
        # the guard's column-backed groups (guard.replicas) give the same list from their rows
        from_rows = getattr(self.seqs, "finish_ends", None)
        if from_rows is not None:
            return from_rows(bs, chunk)
        return sorted(
            (
                (s.num_prefill_tokens_remaining + chunk - 1) // chunk
                + s.num_remaining_output_tokens,
                (
                    s.num_context_tokens
                    + s.num_prefill_tokens_remaining
                    + s.num_remaining_output_tokens
                    + bs
                    - 1
                )
                // bs,
            )
            for s in self.seqs
        )


_EMPTY: dict[tuple[int, int], SeqTotals] = {}  # SeqTotals.empty's, per (block size, chunk)


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's three groups combined into what the predictor needs.

    ``num_committed_blocks`` counts running and waiting sequences only: reserved requests are
    already covered by the guard's worst-case ``num_reserved_blocks``.
    """

    running: SeqTotals
    waiting: SeqTotals
    reserved: SeqTotals
    num_seqs: int
    num_decode_seqs: int  # the decode batch now: the running sequences
    num_running_context_tokens: int
    num_context_tokens: int  # every sequence once its prompt is in: the batch a request joins
    num_queued_prefill_tokens: int  # prompt tokens still to prefill, ahead of a new request
    num_committed_blocks: int
    min_itl_s: float | None

    @classmethod
    def of(cls, running: SeqTotals, waiting: SeqTotals, reserved: SeqTotals) -> ReplicaLoad:
        itls = [g.min_itl_s for g in (running, waiting, reserved) if g.min_itl_s is not None]
        num_prefill = (
            running.num_prefill_tokens + waiting.num_prefill_tokens + reserved.num_prefill_tokens
        )
        num_context = (
            running.num_context_tokens + waiting.num_context_tokens + reserved.num_context_tokens
        )
        return cls(
            running,
            waiting,
            reserved,
            num_seqs=len(running.seqs) + len(waiting.seqs) + len(reserved.seqs),
            num_decode_seqs=len(running.seqs),
            num_running_context_tokens=running.num_context_tokens,
            num_context_tokens=num_context + num_prefill,
            num_queued_prefill_tokens=num_prefill,
            num_committed_blocks=running.num_committed_blocks + waiting.num_committed_blocks,
            min_itl_s=min(itls) if itls else None,
        )

    def with_reserved(self, reserved: SeqTotals) -> ReplicaLoad:
        """This load with ``reserved`` as its reserved group: equal to
        ``ReplicaLoad.of(self.running, self.waiting, reserved)``, from this load's sums."""
        if self.reserved.seqs:  # not engine-only: start from the engine groups
            return ReplicaLoad.of(self.running, self.waiting, reserved)
        itls = [x for x in (self.min_itl_s, reserved.min_itl_s) if x is not None]
        num_prefill = reserved.num_prefill_tokens
        return ReplicaLoad(
            self.running,
            self.waiting,
            reserved,
            num_seqs=self.num_seqs + len(reserved.seqs),
            num_decode_seqs=self.num_decode_seqs,
            num_running_context_tokens=self.num_running_context_tokens,
            num_context_tokens=self.num_context_tokens + reserved.num_context_tokens + num_prefill,
            num_queued_prefill_tokens=self.num_queued_prefill_tokens + num_prefill,
            num_committed_blocks=self.num_committed_blocks,
            min_itl_s=min(itls) if itls else None,
        )

    @cached_property
    def finish_schedule(self) -> FinishSchedule:
        """Each sequence finishes after its prefill chunks and its expected output tokens."""
        ends = sorted(self.running.ends + self.waiting.ends + self.reserved.ends)
        return FinishSchedule(
            num_steps=tuple(e[0] for e in ends),
            num_freed_blocks=tuple(accumulate(e[1] for e in ends)),
        )
