"""Iteration-level scheduler with chunked prefill and preemption by recompute.

One rule, as in vLLM v1: each step gives every scheduled request tokens until its computed
tokens catch up with its known tokens (prompt + generated), within a token budget.

Stall-free batching (as Sarathi-Serve does): every running *decode* (one token left to compute)
is scheduled first, in priority order; prefill chunks share what budget is left — running
requests still prefilling (or recomputing after preemption) first, then waiting ones admitted
while the budget, the sequence cap and the block pool allow. The sequence cap is
``min(max_num_seqs, max_num_batched_tokens)``, so the running decodes always fit the budget.
Hence the invariant: **a decoding sequence that is neither preempted nor finished is scheduled
in every step**, however long the prompts competing for the budget are.

When a request needs a block and none is free, the least important running request not yet
scheduled this step (highest priority value, then latest arrival) is preempted: its blocks are
freed and it waits to be recomputed from scratch. A decode never loses its place to a prefill.

Prefix caching: a request admitted from the waiting queue (new, or preempted) starts its block
table with the longest run of cached blocks matching its leading full blocks, and its computed
tokens start after them. At least one token is always computed (it yields the logits to sample
from), so a prompt cached to its last full block recomputes that block. Once a step has
computed a block's last token, the block is registered under its hash.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from engine.block_hash import block_hash, root_hash
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = (),
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: list[Sequence] = []  # sorted by key, most important first
        self.running: list[Sequence] = []  # sorted by key, most important first
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of which were found cached
        self._seqs: dict[str, Sequence] = {}
        self._next_batch_id = 0
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._key = Sequence.priority_key if config.policy == "priority" else Sequence.fcfs_key

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        self._seqs[seq.request_id] = seq
        self._hash_new_blocks(seq)
        self._enqueue(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        queue.remove(seq)
        del self._seqs[seq.request_id]
        self.block_manager.free(seq.request_id)
        seq.status = status
        self._finished_ids.append(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.append(seq.request_id)
        self._enqueue(seq)

    # ---- one step ---------------------------------------------------------------------
    @property
    def max_running_seqs(self) -> int:
        """The sequence cap: each running decode needs one token of the step's budget."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work: every running decode, then prefill chunks (running ones,
        then waiting ones) within the budget left. Mutates block tables and queues, not token
        counts (except that an admitted request's computed tokens skip its cached prefix)."""
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        chosen_ids: set[str] = set()
        num_preemptions_before = self.num_preemptions
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._allocate_or_preempt(seq, num_new, chosen_ids):
                chosen.append((seq, num_new))
                chosen_ids.add(seq.request_id)
                budget -= num_new
        if self.num_preemptions == num_preemptions_before:
            self._admit_waiting(budget, chosen)
        return self._build_output(chosen)

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, chosen_ids: set[str]) -> bool:
        """Blocks for ``num_new`` more tokens of ``seq``, preempting the least important running
        sequences not chosen yet this step. False when ``seq`` itself had to go."""
        while self.block_manager.allocate(seq.request_id, seq.num_computed_tokens + num_new) is None:
            victim = next(s for s in reversed(self.running) if s.request_id not in chosen_ids)
            self._preempt(victim)  # ``seq`` is unchosen, so the search stops at it at the latest
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, chosen: list[tuple[Sequence, int]]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running_seqs:
            seq = self.waiting[0]  # holds no block and has no computed token
            hits = self.block_manager.find_cached_blocks(
                seq.block_hashes, (seq.num_tokens - 1) // self.block_manager.block_size)
            num_cached = len(hits) * self.block_manager.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                return
            num_new = min(num_new, budget)
            if self.block_manager.allocate(seq.request_id, num_cached + num_new, hits) is None:
                return
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0 and self.block_manager.enable_prefix_caching:
                # recomputes after preemption are not prompt lookups
                seq.num_cached_tokens = num_cached
                self.num_prefix_query_tokens += seq.num_prompt_tokens
                self.num_prefix_hit_tokens += num_cached
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            chosen.append((seq, num_new))
            budget -= num_new

    def _build_output(self, chosen: list[tuple[Sequence, int]]) -> SchedulerOutput:
        scheduled = tuple(self._scheduled_seq(seq, n) for seq, n in chosen)
        output = SchedulerOutput(batch_id=self._next_batch_id, scheduled=scheduled,
                                 finished_request_ids=tuple(self._finished_ids),
                                 preempted_request_ids=tuple(self._preempted_ids),
                                 block_size=self.block_manager.block_size)
        if scheduled:  # keep the ids for the next step a runner will actually see
            self._finished_ids, self._preempted_ids = [], []
            self._next_batch_id += 1
        return output

    def _scheduled_seq(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + num_new),
            num_computed_tokens=start,
            num_prompt_tokens=seq.num_prompt_tokens,
            block_ids=tuple(self.block_manager.block_table(seq.request_id)),
            samples=start + num_new == seq.num_tokens,
            params=seq.params,
        )

    # ---- after the runner ---------------------------------------------------------------
    def update(self, output: SchedulerOutput,
               sampled: dict[str, int]) -> list[tuple[Sequence, tuple[int, ...]]]:
        """Advance token counts, append sampled tokens, finish stopped sequences.
        Returns (sequence, new token ids) for every sequence that sampled."""
        missing = [e.request_id for e in output.scheduled
                   if e.samples and e.request_id not in sampled]
        if missing:
            raise RuntimeError(f"runner returned no token for sampling requests {missing}")
        results = []
        for entry in output.scheduled:
            seq = self._seqs.get(entry.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += entry.num_new_tokens
            self.block_manager.cache_full_blocks(seq.request_id, seq.block_hashes,
                                                 seq.num_computed_tokens, seq.token_slice)
            if not entry.samples:
                continue
            token = sampled[entry.request_id]
            seq.output_token_ids.append(token)
            self._hash_new_blocks(seq)
            status = self._stop_status(seq, token)
            if status is not None:
                self._finish(seq, status)
            results.append((seq, (token,)))
        return results

    def _hash_new_blocks(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over its full blocks of known tokens."""
        if not self.block_manager.enable_prefix_caching:
            return
        size, hashes = self.block_manager.block_size, seq.block_hashes
        while len(hashes) < seq.num_tokens // size:
            parent = (hashes[-1] if hashes
                      else root_hash(self.block_manager.hash_namespace, seq.cache_salt))
            start = len(hashes) * size
            hashes.append(block_hash(parent, seq.token_slice(start, start + size)))

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return SequenceStatus.FINISHED_STOPPED
        if params.stop and self.detokenize is not None:
            text = self.detokenize(seq.output_token_ids)
            if any(stop in text for stop in params.stop):
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- invariants ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Cheap consistency checks; raises AssertionError on a broken invariant."""
        running_ids = {s.request_id for s in self.running}
        waiting_ids = {s.request_id for s in self.waiting}
        assert not running_ids & waiting_ids, "a sequence is both waiting and running"
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert running_ids | waiting_ids == set(self._seqs), "queues disagree with the index"
        assert len(self.running) <= self.max_running_seqs, "too many running sequences"
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING for s in self.waiting)
        assert self.running == sorted(self.running, key=self._key), "running out of order"
        assert self.waiting == sorted(self.waiting, key=self._key), "waiting out of order"
        for seq in self._seqs.values():
            table = self.block_manager.block_table(seq.request_id)
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens
            assert len(table) >= self.block_manager.num_blocks_for(seq.num_computed_tokens)
            for index, block in enumerate(table):  # a cached block holds this very prefix
                cached_hash = self.block_manager.pool.block_hashes[block]
                assert cached_hash is None or (index < len(seq.block_hashes)
                                               and cached_hash == seq.block_hashes[index]), (
                    f"{seq.request_id}: block {block} cached under another prefix")
        assert set(self.block_manager.holders()) <= running_ids | waiting_ids, "leaked blocks"
        self.block_manager.check_invariants()
