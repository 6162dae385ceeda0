"""The guard's in-flight reservations on one replica, with their sums kept incrementally.

A reservation is a request this guard admitted to a replica. It counts in the replica's
``num_inflight`` until its ticket is released, and its load (worst-case blocks, prompt still to
prefill, expected output) counts as *pending* until the replica reports the request itself.

:class:`ReplicaReservations` adds or removes one reservation's contribution per admission,
report and release instead of re-summing every pending reservation for each new snapshot;
:meth:`ReplicaReservations.totals` turns the sums into the reserved group's
:class:`~policies.replica_load.SeqTotals` (equal to ``SeqTotals.of`` over the pending loads).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.cost import RequestCost
from policies.replica_load import SeqTotals, num_blocks_for
from policies.snapshot import SeqLoad

__all__ = ["Reservation", "ReplicaReservations", "reserved_load"]


@dataclass(slots=True)
class Reservation:
    replica_id: str
    cost: RequestCost
    reserved_s: float
    reported: bool = False  # the replica listed it: its blocks are in the replica's own counts
    _load: SeqLoad | None = None
    # the prefix its replica is expected to hold for it (whole blocks): neither allocated nor
    # prefilled again there (RequestCost.num_cached_tokens_on, at the replica's block size)
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0

    @property
    def load(self) -> SeqLoad:
        """Its load as a snapshot lists it, built on first use (most requests end unlisted)."""
        if self._load is None:
            self._load = reserved_load(self.cost, self.reserved_s, self.num_cached_tokens)
        return self._load

    def move_to(self, replica_id: str, now_s: float) -> None:
        """Redispatched: pending on ``replica_id`` from ``now_s`` (the caller books it there,
        with that replica's cache hit)."""
        self.replica_id = replica_id
        self.reserved_s = now_s
        self.reported = False
        self._load = None
        self.num_cached_tokens = self.num_cached_blocks = 0


def reserved_load(cost: RequestCost, reserved_s: float | None = None,
                  num_cached_tokens: int = 0) -> SeqLoad:
    """A reservation's load: nothing computed yet, the prompt (less its cached prefix) and
    expected output to come (from ``reserved_s``, when the prefill pacing may count it as
    draining)."""
    return SeqLoad(
        num_context_tokens=0,
        num_prefill_tokens_remaining=cost.num_prompt_tokens - num_cached_tokens,
        num_remaining_output_tokens=cost.num_expected_output_tokens,
        itl_s=cost.request_class.itl_s,
        admitted_s=reserved_s,
    )


class ReplicaReservations:
    """One replica's reservations: all in flight, the pending ones, and the pending sums."""

    def __init__(self) -> None:
        self.pending: dict[str, Reservation] = {}  # request id -> reservation, in reserve order
        self.num_inflight = 0
        self.num_reserved_blocks = 0  # worst-case blocks of the pending reservations
        self._num_prefill_tokens = 0
        self._itl_counts: dict[float, int] = {}
        self._block_size: int | None = None  # what _num_committed_blocks is counted in
        self._num_committed_blocks = 0

    def add(self, request_id: str, reservation: Reservation) -> None:
        self.num_inflight += 1
        if not reservation.reported:
            self.pending[request_id] = reservation
            self._count(reservation, 1)

    def add_foreign(self, key: str, reservation: Reservation) -> None:
        """Another guard's not-yet-reported admission: pending here, not in ``num_inflight``."""
        if not reservation.reported:
            self.pending[key] = reservation
            self._count(reservation, 1)

    def remove(self, request_id: str) -> None:
        """The reservation's ticket was released."""
        self.num_inflight -= 1
        reservation = self.pending.pop(request_id, None)  # mark_reported, once per request
        if reservation is not None:
            reservation.reported = True
            self._count(reservation, -1)

    def mark_reported(self, request_id: str) -> None:
        """The replica reports the request itself: it stops counting as pending."""
        reservation = self.pending.pop(request_id, None)
        if reservation is not None:
            reservation.reported = True
            self._count(reservation, -1)

    def _count(self, reservation: Reservation, sign: int) -> None:
        """Add (+1) or remove (-1) the contribution of ``reservation.load``: no computed
        context, the prompt less its cached prefix to prefill, the class's ITL limit."""
        cost = reservation.cost
        num_prefill = cost.num_prompt_tokens - reservation.num_cached_tokens
        self.num_reserved_blocks += sign * (cost.num_blocks - reservation.num_cached_blocks)
        self._num_prefill_tokens += sign * num_prefill
        if self._block_size is not None:
            final = num_prefill + cost.num_expected_output_tokens
            self._num_committed_blocks += sign * num_blocks_for(final, self._block_size)
        itl_s = cost.request_class.itl_s
        count = self._itl_counts.get(itl_s, 0) + sign
        if count:
            self._itl_counts[itl_s] = count
        else:
            del self._itl_counts[itl_s]

    def totals(self, block_size: int, chunk_tokens: int) -> SeqTotals:
        """The pending group's sums, equal to ``SeqTotals.of(pending loads, ...)``."""
        seqs = tuple(r.load for r in self.pending.values())
        if block_size != self._block_size:  # first use, or the replica's block size changed
            self._block_size = block_size
            self._num_committed_blocks = sum(_committed_blocks(s, block_size) for s in seqs)
        itls = self._itl_counts
        return SeqTotals(seqs, block_size, chunk_tokens, 0, self._num_prefill_tokens, self._num_committed_blocks,
                         min(itls) if itls else None)


def _committed_blocks(load: SeqLoad, block_size: int) -> int:
    """Blocks the sequence will still grow into (as ``SeqTotals.of`` counts them)."""
    final = load.num_context_tokens + load.num_prefill_tokens_remaining + load.num_remaining_output_tokens
    return num_blocks_for(final, block_size) - num_blocks_for(load.num_context_tokens, block_size)
