"""``BlockTranslator``: another engine's KV-cache events (vLLM's) in kvguard's block chain.

vLLM names a block by its own hash (an algorithm, a version and a per-process root the guard
does not reproduce), so a request's kvguard hashes never match a vLLM replica's events. The
events carry enough to translate instead: a ``BlockStored`` gives its blocks' ``token_ids``
and the ``parent_block_hash`` of the first one. The translator computes kvguard's own chained
hash of each stored block (:func:`guard.replicas.block_hashes.chained_block_hashes`) from the
parent's kvguard hash — the replica's model root when the parent is ``None`` — inserts those
in the prefix index, and remembers each vLLM hash's kvguard hash in a per-replica map, so a
later event chained on it, or a ``BlockRemoved`` naming it, can be applied.
``AllBlocksCleared`` (and the view forgetting the replica) empties both.

Never a wrong hit: a stored event whose parent the map does not hold (the guard subscribed
after it was stored, or the map evicted it), or whose replica's model is not known yet, is
dropped — with the blocks chained on it later — counted in ``num_untranslated`` and logged
once per replica. So is a block whose hash includes what a chain of token ids cannot say (a
LoRA adapter, or vLLM's ``extra_keys``: a ``cache_salt``, multimodal inputs); releases that
publish neither make a salted block look unsalted (docs/architecture.md says what follows).

Memory: the map is one ``OrderedDict`` per replica, bounded like the index (the replica's
capacity in blocks), least recently stored evicted first; an entry holds the vLLM hash (an
int; vLLM's 32-byte hashes as a 256-bit int) and shares its kvguard int with the index. About
150 bytes per tracked block on top of the index's ~127: ~280 in all with vLLM's 32-byte
hashes, ~255 with its 64-bit ones (``scripts/prefix_view_cost.py``, ``docs/benchmarks.md`` §16).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from guard.replicas.block_hashes import chained_block_hashes
from guard.replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from guard.replicas.prefix_index import PrefixIndex

__all__ = ["BlockTranslator"]

log = logging.getLogger("kvguard.kv_events")
_MAX_TOKEN_ID = (1 << 32) - 1


class BlockTranslator:
    """Translates events into ``index``; ``root_of(replica_id)`` is the kvguard root hash of
    the replica's model (None while the model is not known)."""

    def __init__(self, index: PrefixIndex, root_of: Callable[[str], int | None]) -> None:
        self.index = index
        self.root_of = root_of
        self._maps: dict[str, OrderedDict[int, int]] = {}
        self.num_untranslated = 0  # stored events dropped (their chain cannot be known)
        self._logged: set[str] = set()  # replicas whose first untranslated event was logged

    def num_mapped(self, replica_id: str) -> int:
        mapping = self._maps.get(replica_id)
        return len(mapping) if mapping is not None else 0

    @staticmethod
    def check(events: Sequence[KvEvent]) -> None:
        """ValueError unless every stored event's ``token_ids`` are its blocks' (ints, as many
        as its blocks hold): the batch is then dropped whole, before anything is applied."""
        for event in events:
            if not isinstance(event, BlockStored):
                continue
            tokens = event.token_ids
            if len(tokens) != len(event.block_hashes) * event.block_size:
                raise ValueError(f"BlockStored has {len(tokens)} token ids for "
                                 f"{len(event.block_hashes)} blocks of {event.block_size}")
            for t in tokens:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID:
                    raise ValueError(f"a token id must be an int in [0, 2**32), got {t!r:.40}")

    def apply(self, replica_id: str, events: Sequence[KvEvent]) -> None:
        """Apply one checked batch in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self.stored(replica_id, event)
            elif isinstance(event, BlockRemoved):
                self.removed(replica_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.forget(replica_id)

    def stored(self, replica_id: str, event: BlockStored) -> bool:
        """Insert the event's blocks as kvguard's chain; False (counted) when it cannot be."""
        if event.keyed:
            return self._untranslated(replica_id, "a LoRA or extra-keyed (salted, multimodal) "
                                                  "block")
        if event.parent_block_hash is None:
            parent = self.root_of(replica_id)
            if parent is None:
                return self._untranslated(replica_id, "the replica's model is not known yet")
        else:
            parent = self._maps.get(replica_id, {}).get(event.parent_block_hash)
            if parent is None:
                return self._untranslated(replica_id, "its parent block is not tracked")
        hashes = chained_block_hashes(parent, event.token_ids, event.block_size)
        mapping = self._maps.get(replica_id)
        if mapping is None:
            mapping = self._maps[replica_id] = OrderedDict()
        for theirs, ours in zip(event.block_hashes, hashes, strict=True):
            mapping[theirs] = ours
            mapping.move_to_end(theirs)
        excess = len(mapping) - self.index.capacity(replica_id)
        for _ in range(excess):
            mapping.popitem(last=False)
        self.index.insert(replica_id, hashes)
        return True

    def removed(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """The replica evicted these blocks (their hashes unknown here are ignored)."""
        mapping = self._maps.get(replica_id)
        if not mapping:
            return
        ours = [h for h in (mapping.pop(theirs, None) for theirs in block_hashes)
                if h is not None]
        self.index.remove(replica_id, ours)

    def forget(self, replica_id: str) -> None:
        """The replica's cache is empty (cleared, restarted, or events were lost)."""
        self._maps.pop(replica_id, None)
        self.index.clear(replica_id)

    def _untranslated(self, replica_id: str, why: str) -> bool:
        self.num_untranslated += 1
        if replica_id not in self._logged:
            self._logged.add(replica_id)
            log.warning("a stored KV event from %r is not tracked (%s): its blocks and those "
                        "chained on them are priced as uncached; later ones are only counted "
                        "(kvguard_kv_events_untranslated_total)", replica_id, why)
        return False
