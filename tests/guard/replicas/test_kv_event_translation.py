"""vLLM's KV-cache events translated into kvguard's block chain (BlockTranslator through
KvEvents): stored, chained, removed, cleared; what cannot be translated (unknown parent,
unknown model, LoRA or extra-keyed blocks) is a counted, logged drop; a malformed batch is a
logged drop that leaves the index and the map as they were. Payloads are built as vLLM's
msgspec encoder writes them: arrays (``array_like``) or, the newest releases, maps."""

import logging

import msgpack
import pytest

from guard.replicas.block_hashes import root_hash, token_block_hashes
from guard.replicas.kv_event_translation import BlockTranslator
from guard.replicas.kv_events import KvEvents
from guard.replicas.prefix_index import PrefixIndex

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4


def vh(i):
    """A vLLM block hash as its default sha256 publishes it: 32 bytes."""
    return i.to_bytes(32, "big")


def stored_map(hashes, parent, tokens, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, **extra}


def stored_array(hashes, parent, tokens):
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


def batch_map(*events):
    return msgpack.packb({"ts": 1.0, "events": list(events), "data_parallel_rank": 0})


def batch_array(*events):
    return msgpack.packb([1.0, list(events), 0])


def ours(tokens):
    return token_block_hashes(tokens, BS, MODEL)


@pytest.fixture
def setup():
    index = PrefixIndex(100)
    models = {"v": MODEL}
    translator = BlockTranslator(index, lambda r: root_hash(models[r]) if r in models else None)
    events = KvEvents(index, {"v", "k", "nomodel"}, translated=lambda r: r != "k",
                      translator=translator)
    return index, translator, events


def test_a_stored_prompt_is_kvguards_chain_of_its_tokens(setup):
    index, translator, events = setup
    assert events.apply("v", batch_map(stored_map([vh(1), vh(2)], None, TOKENS[:8])))
    assert index.num_matched("v", ours(TOKENS)) == 2
    assert translator.num_mapped("v") == 2


@pytest.mark.parametrize("encode, stored", [(batch_map, stored_map),
                                            (batch_array, stored_array)])
def test_chained_stores_continue_the_chain_across_and_within_batches(setup, encode, stored):
    index, _, events = setup
    assert events.apply("v", encode(stored([vh(1), vh(2)], None, TOKENS[:8])))
    assert events.apply("v", encode(stored([vh(3)], vh(2), TOKENS[8:12]),
                                    stored([vh(4), vh(5)], vh(3), TOKENS[12:20])))
    assert index.num_matched("v", ours(TOKENS)) == 5
    # another prompt sharing the first two blocks only
    other = TOKENS[:8] + [7, 7, 7, 7]
    assert events.apply("v", encode(stored([vh(9)], vh(2), other[8:])))
    assert index.num_matched("v", ours(other)) == 3


def test_int_hashes_translate_too(setup):
    index, _, events = setup  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the low 64 bits
    assert events.apply("v", batch_array(stored_array([11, 12], None, TOKENS[:8]),
                                         stored_array([13], 12, TOKENS[8:12])))
    assert index.num_matched("v", ours(TOKENS)) == 3


def test_removed_blocks_leave_the_index_and_the_map(setup):
    index, translator, events = setup
    events.apply("v", batch_map(stored_map([vh(1), vh(2), vh(3)], None, TOKENS[:12])))
    assert events.apply("v", batch_map({"type": "BlockRemoved", "block_hashes": [vh(2), vh(77)],
                                        "medium": "GPU"}))
    assert index.num_matched("v", ours(TOKENS)) == 1
    assert translator.num_mapped("v") == 2
    # a block chained on the removed one can no longer be placed
    assert events.apply("v", batch_map(stored_map([vh(4)], vh(2), TOKENS[12:16])))
    assert translator.num_untranslated == 1


def test_all_blocks_cleared_empties_the_replica(setup):
    index, translator, events = setup
    events.apply("v", batch_map(stored_map([vh(1)], None, TOKENS[:4])))
    assert events.apply("v", batch_map({"type": "AllBlocksCleared"}))
    assert index.num_blocks("v") == 0 and translator.num_mapped("v") == 0


def test_an_unknown_parent_drops_that_chain_counted_and_logged_once(setup, caplog):
    index, translator, events = setup
    with caplog.at_level(logging.WARNING, logger="kvguard.kv_events"):
        # subscribed late: the parent was stored before the guard listened
        assert events.apply("v", batch_map(stored_map([vh(3)], vh(2), TOKENS[8:12]),
                                           stored_map([vh(4)], vh(3), TOKENS[12:16]),
                                           stored_map([vh(1)], None, TOKENS[:4])))
    assert translator.num_untranslated == 2
    assert caplog.text.count("is not tracked (its parent block is not tracked)") == 1
    assert index.num_blocks("v") == 1 and index.num_matched("v", ours(TOKENS)) == 1
    assert events.num_dropped == 0  # not malformed: the rest of the batch was applied


@pytest.mark.parametrize("event", [
    stored_map([vh(1)], None, TOKENS[:4], lora_id=3),
    stored_map([vh(1)], None, TOKENS[:4], lora_name="sql-adapter"),
    stored_map([vh(1)], None, TOKENS[:4], extra_keys=[("tenant-salt",)]),
])
def test_lora_and_extra_keyed_blocks_are_not_translated(setup, event):
    index, translator, events = setup
    assert events.apply("v", batch_map(event))
    assert index.num_blocks("v") == 0 and translator.num_untranslated == 1


def test_unkeyed_extra_keys_translate(setup):
    index, _, events = setup
    assert events.apply("v", batch_map(stored_map([vh(1)], None, TOKENS[:4],
                                                  extra_keys=[None])))
    assert index.num_matched("v", ours(TOKENS)) == 1


def test_a_replica_whose_model_is_unknown_is_not_translated(setup):
    index, translator, events = setup
    assert events.apply("nomodel", batch_map(stored_map([vh(1)], None, TOKENS[:4])))
    assert index.num_blocks("nomodel") == 0 and translator.num_untranslated == 1


def test_a_kvguard_replicas_hashes_are_applied_as_they_are(setup):
    index, translator, events = setup
    assert events.apply("k", batch_array(stored_array([5, 6], None, TOKENS[:8])))
    assert index.num_matched("k", [5, 6]) == 2 and translator.num_mapped("k") == 0


@pytest.mark.parametrize("payload", [
    batch_map(stored_map([vh(1), vh(2)], None, TOKENS[:7])),  # a token short
    batch_map(stored_map([vh(1)], None, [1, 2, -3, 4])),
    batch_map(stored_map([vh(1)], None, [1, 2, "3", 4])),
    batch_map(stored_map([vh(1)], None, [1, 2, True, 4])),
    batch_map(stored_map([vh(1)], None, [1, 2, 3, 1 << 32])),
    batch_map(stored_map([vh(1)], None, TOKENS[:4], block_size=0)),
    batch_map(stored_map([vh(1)], None, "abcd")),
    batch_map({"type": "BlockStored", "block_hashes": [vh(1)], "parent_block_hash": None,
               "block_size": BS}),  # no token_ids
    batch_map({"type": "BlockRemoved"}),
    batch_map({"type": "Nope"}),
    batch_map(stored_map([b"\x01" * 65], None, TOKENS[:4])),  # not a hash
    msgpack.packb({"ts": 1.0}),
    # one bad event spoils the whole batch, the good one before it included
    batch_map(stored_map([vh(8)], vh(1), TOKENS[4:8]), stored_map([vh(9)], None, [1])),
])
def test_a_malformed_batch_is_a_logged_drop_that_changes_nothing(setup, payload, caplog):
    index, translator, events = setup
    events.apply("v", batch_map(stored_map([vh(1)], None, TOKENS[:4])))
    with caplog.at_level(logging.WARNING, logger="kvguard.kv_events"):
        assert not events.apply("v", payload)
    assert events.num_dropped == 1 and "dropped a KV event batch" in caplog.text
    assert index.num_blocks("v") == 1 and translator.num_mapped("v") == 1
    assert translator.num_untranslated == 0


def test_the_map_is_bounded_like_the_index():
    index = PrefixIndex(100)
    index.set_capacity("v", 3)
    translator = BlockTranslator(index, lambda r: root_hash(MODEL))
    events = KvEvents(index, {"v"}, translated=lambda r: True, translator=translator)
    events.apply("v", batch_map(stored_map([vh(i) for i in range(1, 6)], None, TOKENS[:20])))
    assert index.num_blocks("v") == 3 and translator.num_mapped("v") == 3
    # the oldest mappings went first: the newest block can still be chained on
    assert events.apply("v", batch_map(stored_map([vh(6)], vh(5), TOKENS[20:24])))
    assert translator.num_untranslated == 0
