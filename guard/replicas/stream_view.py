"""A streamed replica's sequence groups, kept up to date in O(what changed).

:class:`StreamGroup` applies :mod:`serving.state_delta`'s changes to one group (``running`` or
``waiting``) of a replica's compact document without rebuilding it: a row is stored as its
values at the cumulative decode advance when it was last set, so one ``advance`` of ``k``
steps is a counter (plus a 16-bucket histogram that says how many decoding sequences cross a
KV block boundary), and the sums a snapshot needs — context and prefill tokens, the blocks
the group will still grow into — are running sums adjusted per changed row. :meth:`capture`
freezes the group into a :class:`GroupCapture`, sharing its rows dict: the group copies the
dict before it next changes a row, so an event that only advances the group (most of them:
decode steps, no sequence in or out) copies nothing, and one that changes a row copies the
dict once (issue #35: a copy, and later its release, of 256 rows was ~8 µs of an event in a
proxy). The capture gives the
snapshot its :class:`~policies.replica_load.SeqTotals` with the guard's own requests (few)
corrected one by one, and its :class:`~policies.seq_load.SeqLoad` only if a policy walks the
group. Equal, field by field, to what :mod:`guard.replicas.documents` builds from the same
compact document (the tests compare them).

A row whose remaining output is not ``max_tokens - output`` for a foreign request — no
``max_tokens``, or past it — makes the group *irregular*: its sums are then taken the plain
way from the columns (exact, O(sequences)) until no such row is left. A decoding row that
decode steps carry past its ``max_tokens`` (an engine stops it there; a synthetic one may
not) turns irregular at that step: each is found by when it will, kept in a heap.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

from policies.cost import RequestCost
from policies.replica_load import SeqTotals
from policies.seq_load import SeqLoad

__all__ = ["GroupCapture", "StreamGroup"]

_OUT, _MAX, _CTX, _PRE, _AT = range(5)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class StreamGroup:
    """One group's rows (request id -> output, max_tokens, context, prefill, advance mark)."""

    def __init__(self, block_size: int, advances: bool) -> None:
        self.block_size = block_size
        self.advances = advances  # the running group: decode steps advance its rows
        self.rows: dict[str, tuple] = {}  # read here; changed only through _own_rows()
        self._shared = False  # a capture holds ``rows``: copied before a row changes
        self.advance = 0  # cumulative decode steps
        self._static_ctx = 0  # context of the rows that do not advance
        self._static_ctx_blocks = 0
        self._dec_ctx_base = 0  # sum over decoding rows of (context - their advance mark)
        self._dec_ctx_blocks = 0  # sum over decoding rows of ceil(context / block size) now
        self._num_dec = 0
        self._hist = [0] * block_size  # decoding rows by (context - mark - 1) mod block size
        self.num_prefill = 0
        self._final_blocks = 0  # sum of ceil(final / block size), final = ctx + pre + max - out
        self.num_irregular = 0
        # (the advance at which it passes its max_tokens, request id, row) per regular
        # decoding row; entries of rows changed or removed since are skipped when they come up
        self._past_max: list[tuple[int, str, tuple]] = []

    # --- one row in or out ---------------------------------------------------------------
    def _count(self, row: tuple, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) one row's part of the sums (every row goes in
        and out through here: a plain function body, it runs on every changed row)."""
        bs = self.block_size
        out, max_tokens, ctx, pre, at = row
        decoding = self.advances and not pre
        if decoding:  # its values now: the decode steps since it was set added
            out += self.advance - at
            ctx += self.advance - at
        self.num_prefill += sign * pre
        if max_tokens is None or max_tokens < out:
            self.num_irregular += sign
        else:
            self._final_blocks += sign * -(-(ctx + pre + max_tokens - out) // bs)
        if decoding:
            self._num_dec += sign
            self._dec_ctx_base += sign * (row[_CTX] - at)
            self._dec_ctx_blocks += sign * -(-ctx // bs)
            self._hist[(row[_CTX] - at - 1) % bs] += sign
        else:
            self._static_ctx += sign * ctx
            self._static_ctx_blocks += sign * -(-ctx // bs)

    def set(self, request_id: str, out: int, max_tokens: int | None, ctx: int, pre: int) -> None:
        """A row new to the group, or changed: its values now."""
        old = self.rows.get(request_id)
        if old is not None:
            self._count(old, -1)
        row = (out, max_tokens, ctx, pre, self.advance)
        self._own_rows()[request_id] = row
        self._count(row, 1)
        if self.advances and not pre and max_tokens is not None and max_tokens >= out:
            past_max = self._past_max
            heapq.heappush(past_max, (self.advance + max_tokens - out + 1, request_id, row))
            if len(past_max) > 2 * len(self.rows) + 32:  # mostly rows gone before their max
                self._rebuild_past_max()

    def _rebuild_past_max(self) -> None:
        """The heap of :meth:`step` anew from the rows there are (a row removed or changed
        leaves its entry behind until it comes up: this bounds them to the rows' number)."""
        entries = []
        for rid, row in self.rows.items():
            out, max_tokens, _, pre, at = row
            # a regular decoding row not yet past its max_tokens (those are irregular now)
            if not pre and max_tokens is not None and at + max_tokens - out >= self.advance:
                entries.append((at + max_tokens - out + 1, rid, row))
        heapq.heapify(entries)
        self._past_max = entries

    def remove(self, request_id: str) -> None:
        self._count(self._own_rows().pop(request_id), -1)

    def _own_rows(self) -> dict[str, tuple]:
        """``rows``, to be changed: a copy first when a capture holds it."""
        if self._shared:
            self.rows = self.rows.copy()
            self._shared = False
        return self.rows

    def share_rows(self) -> dict[str, tuple]:
        """``rows`` for a capture, which must never change it (the group copies it before
        changing a row from now on)."""
        self._shared = True
        return self.rows

    def step(self, k: int) -> None:
        """``k`` decode steps for every decoding row (those set since are set after it)."""
        if not k or not self.advances:
            return
        # A row in histogram bucket ``key`` sits at (key + advance) mod bs: k steps take it
        # across k // bs block boundaries, and one more when it is among the last k % bs
        # places of its block — a cyclic run of k % bs buckets, summed as slices.
        bs, a, hist = self.block_size, self.advance, self._hist
        r = k % bs
        crossed = (k // bs) * self._num_dec
        if r:
            start = (bs - r - a) % bs
            end = start + r
            crossed += sum(hist[start:end]) if end <= bs else \
                sum(hist[start:]) + sum(hist[:end - bs])
        self._dec_ctx_blocks += crossed
        self.advance = a + k
        past_max = self._past_max
        while past_max and past_max[0][0] <= self.advance:  # output now past max_tokens
            _, rid, row = heapq.heappop(past_max)
            if self.rows.get(rid) is row:  # still the row set then: irregular from now on
                out, max_tokens, ctx, pre, _ = row  # (its final is the same at any advance)
                self._final_blocks -= -(-(ctx + pre + max_tokens - out) // bs)
                self.num_irregular += 1

    def reorder(self, order: list[str]) -> None:
        self.rows = {rid: self.rows[rid] for rid in order}  # a new dict: no capture holds it
        self._shared = False

    def apply(self, change: Mapping[str, Any], k: int) -> None:
        """One group's part of a delta (``k``: its ``advance``, applied before the upserts:
        an upserted row carries its values of now)."""
        for rid in change.get("remove", ()):
            self.remove(rid)
        self.step(k)
        upsert = change.get("upsert")
        if upsert:
            for rid, out, max_tokens, ctx, pre in zip(
                    upsert["request_id"], upsert["num_output_tokens"], upsert["max_tokens"],
                    upsert["num_context_tokens"], upsert["num_prefill_tokens_remaining"],
                    strict=True):
                self.set(rid, out, max_tokens, ctx, pre)
        order = change.get("order")
        if order is not None:
            self.reorder(order)

    def load(self, columns: Mapping[str, list]) -> None:
        """Start over from a full document's columns."""
        self.__init__(self.block_size, self.advances)
        for rid, out, max_tokens, ctx, pre in zip(
                columns["request_id"], columns["num_output_tokens"], columns["max_tokens"],
                columns["num_context_tokens"], columns["num_prefill_tokens_remaining"],
                strict=True):
            self.set(rid, out, max_tokens, ctx, pre)

    # --- reading ------------------------------------------------------------------------
    def capture(self) -> GroupCapture:
        """This group now, frozen (later changes do not reach it)."""
        return GroupCapture(self)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.rows


class GroupCapture:
    """One group as of :meth:`StreamGroup.capture`: its columns on demand, its totals."""

    __slots__ = ("_rows", "_advance", "_advances", "_bs", "_sums", "_irregular")

    def __init__(self, group: StreamGroup) -> None:
        self._rows = group.share_rows()
        self._advance, self._advances, self._bs = group.advance, group.advances, group.block_size
        dec_ctx = group._dec_ctx_base + group._num_dec * group.advance
        self._sums = (group._static_ctx + dec_ctx, group.num_prefill,
                      group._final_blocks - group._static_ctx_blocks - group._dec_ctx_blocks)
        self._irregular = group.num_irregular > 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self) -> list[tuple]:
        """(request id, output, max_tokens, context, prefill) per sequence, in order."""
        a, advances = self._advance, self._advances
        out = []
        for rid, (o, m, c, p, at) in self._rows.items():
            k = a - at if advances and not p else 0
            out.append((rid, o + k, m, c + k, p))
        return out

    def finish_ends(self, block_size: int, chunk_tokens: int) -> list[tuple[int, int]]:
        """``SeqTotals.ends`` of the group when none of its sequences is the guard's (every
        remaining output is ``max_tokens`` less the output; one token without one): ``(steps
        until finished, final blocks)`` per sequence, sorted, straight from the rows."""
        a, advances, bs, chunk = self._advance, self._advances, block_size, chunk_tokens
        ends = []
        for o, m, c, p, at in self._rows.values():
            if p:  # in prefill: its chunks, then its output
                r = 1 if m is None else m - o if m > o else 0
                ends.append(((p + chunk - 1) // chunk + r, (c + p + r + bs - 1) // bs))
            else:  # decoding: the advances since its row was written count
                k = a - at if advances else 0
                r = 1 if m is None else m - o - k if m > o + k else 0
                ends.append((r, (c + k + r + bs - 1) // bs))
        ends.sort()
        return ends

    def columns(self) -> dict[str, list]:
        """The compact document's columns of this group."""
        rows = self.rows()
        return {name: [r[i] for r in rows] for i, name in enumerate(
            ("request_id", "num_output_tokens", "max_tokens", "num_context_tokens",
             "num_prefill_tokens_remaining"))}

    def totals(self, our_cost: Callable[[str], RequestCost | None], ours: Container[str] | None,
               chunk_tokens: int, plain: Callable[..., SeqTotals]) -> SeqTotals:
        """The group's :class:`SeqTotals` with the guard's own requests (``ours``: at least
        their ids) priced as theirs; ``plain(columns, ...)`` when the group is irregular."""
        if self._irregular or ours is None:
            return plain(self.columns(), our_cost, self._bs, chunk_tokens, ours)
        num_context, num_prefill, num_committed = self._sums
        bs, rows = self._bs, self._rows
        costs: dict[str, RequestCost] = {}
        min_itl_s = None
        for rid in ours if len(ours) < len(rows) else rows:  # the smaller side
            if rid not in rows or rid not in ours:
                continue
            cost = our_cost(rid)
            if cost is None:
                continue
            costs[rid] = cost
            o, m, c, p, at = rows[rid]
            k = self._advance - at if self._advances and not p else 0
            o, c = o + k, c + k
            expected = max(1, cost.num_expected_output_tokens - o)
            remaining = min(max(0, m - o), expected)
            num_committed += _blocks(c + p + remaining, bs) - _blocks(c + p + m - o, bs)
            itl_s = cost.request_class.itl_s
            if min_itl_s is None or itl_s < min_itl_s:
                min_itl_s = itl_s
        return SeqTotals(CapturedSeqs(self, costs), bs, chunk_tokens, num_context, num_prefill,
                         num_committed, min_itl_s)


class LazySeqLoads(Sequence):
    """A group's sequences as :class:`SeqLoad` records, made by :meth:`_make` on first use
    (most decisions read only a group's totals); equal to the tuple of those, either way
    round. ``len()`` needs no records: it is on every least-loaded comparison."""

    __slots__ = ("_seqs", "_n")

    def __init__(self, n: int) -> None:
        self._seqs: tuple[SeqLoad, ...] | None = None
        self._n = n

    @abstractmethod
    def _make(self) -> tuple[SeqLoad, ...]:
        """The records, once (the subclass's rows as :class:`SeqLoad`)."""

    @abstractmethod
    def _row_tuples(self) -> Iterator[tuple]:
        """(output, max_tokens, context, prefill, the guard's cost or None) per sequence, in
        order (before :meth:`_make`)."""

    def _loads(self) -> tuple[SeqLoad, ...]:
        if self._seqs is None:
            self._seqs = self._make()
        return self._seqs

    def finish_ends(self, block_size: int, chunk_tokens: int) -> list[tuple[int, int]]:
        """``SeqTotals.ends`` of these sequences (``chunk_tokens`` >= 1), from the rows when
        no record was made yet: the fleet's ranking forecasts every changed replica, and a
        record per sequence would cost it more than the forecast."""
        from guard.replicas.documents import finish_ends, seq_ends

        if self._seqs is None:
            return finish_ends(self._row_tuples(), block_size, chunk_tokens)
        return seq_ends(((s.num_remaining_output_tokens, s.num_context_tokens,
                          s.num_prefill_tokens_remaining) for s in self._seqs),
                        block_size, chunk_tokens)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):  # noqa: ANN001 - int or slice, as a tuple's
        return self._loads()[index]

    def __iter__(self) -> Iterator[SeqLoad]:
        return iter(self._loads())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self._loads() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._loads())

    def __repr__(self) -> str:
        return repr(self._loads())


class CapturedSeqs(LazySeqLoads):
    """A captured group as a sequence of :class:`SeqLoad` (made on first use)."""

    __slots__ = ("_capture", "_costs")

    def __init__(self, capture: GroupCapture, costs: dict[str, RequestCost]) -> None:
        super().__init__(len(capture))
        self._capture, self._costs = capture, costs

    def _make(self) -> tuple[SeqLoad, ...]:
        from guard.replicas.documents import seq_fields

        return tuple(seq_fields(*row) for row in self._row_tuples())

    def _row_tuples(self) -> Iterator[tuple]:
        cost_of = self._costs.get
        return ((o, m, c, p, cost_of(rid)) for rid, o, m, c, p in self._capture.rows())

    def finish_ends(self, block_size: int, chunk_tokens: int) -> list[tuple[int, int]]:
        if self._costs or self._seqs is not None:
            return super().finish_ends(block_size, chunk_tokens)
        return self._capture.finish_ends(block_size, chunk_tokens)  # the replica's own alone
