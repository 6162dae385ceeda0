"""Paged KV cache bookkeeping: a pool of reference-counted blocks, per-request block tables,
and the prefix cache over them.

Only ids, counts and hashes live here; the K/V tensors belong to the runner. Blocks are handed
out from the front of a free queue and returned to its back, so block ids are deterministic.

Prefix caching (``enable_prefix_caching``): a full block whose KV is computed is registered
under its chained hash (``engine.block_hash``). When its last holder frees it, it keeps the
hash and joins the back of the free queue: still reusable by any request whose prompt starts
with the same blocks, until ``take`` pops it from the front for other tokens, which evicts it
(least recently freed first). A request frees its blocks tail first, so a prompt's later blocks
go before the earlier ones that more prompts share. The pool records the KV events (stored,
removed, cleared) while ``events`` is a list.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["BlockManager", "BlockPool"]


class BlockPool:
    """``num_blocks`` blocks, each with a reference count and an optional cached hash.

    A block is free exactly when its count is 0; a free block with a hash is *evictable*.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.events: list[KVCacheEvent] | None = None  # a list while someone consumes them
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks))
        self._num_evictable = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    def take(self, num: int) -> list[int] | None:
        """``num`` blocks with count 1 from the front of the free queue (evicting any cached
        one among them), or None (and nothing taken) if too few are free."""
        if num > len(self._free):
            return None
        blocks = []
        for _ in range(num):
            block, _ = self._free.popitem(last=False)
            if self.block_hashes[block] is not None:
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        del self.cached[block_hash]
        self.block_hashes[block] = None
        self._num_evictable -= 1
        if self.events is not None:
            self.events.append(BlockRemoved((block_hash,)))

    def touch(self, block: int) -> None:
        """Take one more reference on a cached block, free or not (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
            if self.block_hashes[block] is not None:
                self._num_evictable -= 1
        self.ref_counts[block] += 1

    def share(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} released more often than taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self.block_hashes[block] is not None:
                self._num_evictable += 1

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def store(self, block: int, block_hash: int) -> bool:
        """Register a held, computed, full block under its hash. False (nothing changes) when
        another block already holds that hash or this one already has a hash."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free and cannot be cached")
        if block_hash in self.cached or self.block_hashes[block] is not None:
            return False
        self.cached[block_hash] = block
        self.block_hashes[block] = block_hash
        return True

    def reset(self) -> bool:
        """Forget every cached hash; only when no block is held (else False, nothing done)."""
        if len(self._free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self._num_evictable = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def check_invariants(self) -> None:
        assert len(self._free) == sum(1 for c in self.ref_counts if c == 0), "free queue size"
        for block, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block} has negative count {count}"
            assert (count == 0) == (block in self._free), f"block {block}: count {count} vs free"
        for block_hash, block in self.cached.items():
            assert self.block_hashes[block] == block_hash, f"block {block}: hash map disagrees"
        assert sum(h is not None for h in self.block_hashes) == len(self.cached), "stray hash"
        evictable = sum(1 for b in self.cached.values() if self.ref_counts[b] == 0)
        assert evictable == self._num_evictable, "evictable count drifted"


class BlockManager:
    """Per-request block tables over one BlockPool, with an optional prefix cache.

    ``hash_namespace`` is the model name the block hashes are rooted in (``engine.block_hash``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_namespace: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_namespace = hash_namespace
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already registered

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    # ---- prefix cache -------------------------------------------------------------------
    def find_cached_blocks(self, block_hashes: Sequence[int], max_num_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of ``block_hashes`` (at most
        ``max_num_blocks``); empty without prefix caching. Changes nothing."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[int],
                          num_computed_tokens: int,
                          token_slice: Callable[[int, int], Sequence[int]]) -> None:
        """Register the request's blocks that are full and computed (``block_hashes[i]`` is
        the hash of its block ``i``; ``token_slice(start, stop)`` its tokens, for events)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        start = self._num_hashed.get(request_id, 0)
        stop = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        if stop <= start:
            return
        run: list[int] = []  # consecutive block indices stored by this call
        for i in range(start, stop):
            if self.pool.store(table[i], block_hashes[i]):
                run.append(i)
                continue
            self._stored_event(run, block_hashes, token_slice)
            run = []
        self._stored_event(run, block_hashes, token_slice)
        self._num_hashed[request_id] = stop

    def _stored_event(self, run: list[int], block_hashes: Sequence[int],
                      token_slice: Callable[[int, int], Sequence[int]]) -> None:
        if not run or self.pool.events is None:
            return
        first, last, size = run[0], run[-1], self.block_size
        self.pool.events.append(BlockStored(
            block_hashes=tuple(block_hashes[first : last + 1]),
            parent_block_hash=block_hashes[first - 1] if first else None,
            token_ids=tuple(token_slice(first * size, (last + 1) * size)), block_size=size))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (nothing done) while any block is held."""
        return self.pool.reset()

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int,
                 cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens in total.

        ``cached_blocks`` (from ``find_cached_blocks``, for a request holding no block yet)
        start its table, shared by reference. Returns the newly taken blocks (possibly none),
        or None when the pool cannot supply them — then nothing changes and the caller decides
        whom to preempt.
        """
        table = self._tables.get(request_id, [])
        if cached_blocks and table:
            raise ValueError(f"{request_id} already holds blocks; cached blocks start a table")
        num_needed = self.num_blocks_for(num_tokens) - len(table) - len(cached_blocks)
        if num_needed <= 0 and not cached_blocks:
            return []
        num_needed = max(num_needed, 0)
        num_free_hits = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_needed + num_free_hits > self.pool.num_free_blocks:
            return None
        for block in cached_blocks:
            self.pool.touch(block)
        new_blocks = self.pool.take(num_needed)
        assert new_blocks is not None  # checked above
        if cached_blocks:
            self._num_hashed[request_id] = len(cached_blocks)
        self._tables[request_id] = table + list(cached_blocks) + new_blocks
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (reference counted)."""
        if child_id in self._tables:
            raise ValueError(f"{child_id} already holds blocks")
        table = list(self._tables.get(parent_id, []))
        for block in table:
            self.pool.share(block)
        self._tables[child_id] = table
        self._num_hashed[child_id] = self._num_hashed.get(parent_id, 0)

    def free(self, request_id: str) -> int:
        """Release every block of the request (tail first when caching: the tail is evicted
        first); returns how many it held."""
        table = self._tables.pop(request_id, [])
        self._num_hashed.pop(request_id, None)
        for block in (reversed(table) if self.enable_prefix_caching else table):
            self.pool.release(block)
        return len(table)

    def holders(self) -> list[str]:
        return list(self._tables)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call (empty unless recording)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.pool.ref_counts, "block tables disagree with reference counts"
        assert set(self._num_hashed) <= set(self._tables), "hash progress of a freed request"
