"""KV-cache events in vLLM's format applied to the prefix index; bad input is a logged drop
that leaves the index as it was; a real ZMQ PUB -> SUB over loopback."""

import asyncio
import logging

import msgpack
import pytest
import zmq

from guard.replicas.kv_events import KvEvents, KvEventSubscriber, decode_batch, resolve_endpoint
from guard.replicas.prefix_index import PrefixIndex


def batch(*events, ts=1.5):
    return msgpack.packb([ts, [list(e) for e in events], 0])


def stored(hashes, parent=None):
    return ["BlockStored", hashes, parent, list(range(16 * len(hashes))), 16, None, "GPU"]


def test_stored_removed_and_cleared_change_the_index():
    index = PrefixIndex(100)
    events = KvEvents(index, {"a"})
    assert events.apply("a", batch(stored([1, 2, 3]), stored([4], parent=3)))
    assert index.num_matched("a", [1, 2, 3, 4]) == 4
    assert events.apply("a", batch(["BlockRemoved", [2], "GPU"]))
    assert index.num_matched("a", [1, 2, 3, 4]) == 1
    assert events.apply("a", batch(["AllBlocksCleared"]))
    assert index.num_blocks("a") == 0
    # newer vLLM sends bytes hashes: tracked as big-endian ints
    assert decode_batch(batch(stored([b"\x00\x01"])))[0].block_hashes == (1,)


@pytest.mark.parametrize("payload", [
    b"\xc1 not msgpack",
    msgpack.packb({"ts": 1}),
    msgpack.packb([1.0, "events"]),
    batch(["BlockStored", [1]]),  # short
    batch(["Nope", [1]]),
    batch(stored([1, 2]), stored([-5])),  # one bad hash spoils the whole batch
    batch(stored([1.5])),
    batch(stored(["x"])),
])
def test_a_malformed_batch_is_a_logged_drop_that_leaves_the_index_alone(payload, caplog):
    index = PrefixIndex(100)
    index.insert("a", [7])
    events = KvEvents(index, {"a"})
    with caplog.at_level(logging.WARNING, logger="kvguard.kv_events"):
        assert not events.apply("a", payload)
    assert events.num_dropped == 1 and "dropped a KV event batch" in caplog.text
    assert index.replica_ids() == ("a",) and index.num_blocks("a") == 1


def test_events_from_an_unknown_replica_are_dropped(caplog):
    index = PrefixIndex(100)
    events = KvEvents(index, {"a"})
    with caplog.at_level(logging.WARNING, logger="kvguard.kv_events"):
        assert not events.apply("intruder", batch(stored([1])))
    assert index.replica_ids() == () and "unknown replica" in caplog.text


def test_an_advertised_wildcard_endpoint_is_reached_at_the_replicas_host():
    assert resolve_endpoint("tcp://*:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "http://h:1") == "tcp://h:5557"
    assert resolve_endpoint("tcp://127.0.0.1:5557", "http://h:1") == "tcp://127.0.0.1:5557"
    assert resolve_endpoint("ipc:///tmp/x", "http://h:1") == "ipc:///tmp/x"


def test_a_real_publisher_feeds_the_index_over_zmq():
    async def scenario():
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        index = PrefixIndex(100)
        gaps = []
        subscriber = KvEventSubscriber(KvEvents(index, {"a"}), on_gap=gaps.append)
        subscriber.subscribe("a", f"tcp://127.0.0.1:{port}")
        try:
            seq = 0
            for _ in range(200):  # a SUB joins late: publish until one arrives (bounded)
                pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(stored([11, 12]))])
                seq += 1
                await asyncio.sleep(0.01)
                if index.num_blocks("a"):
                    break
            assert index.num_matched("a", [11, 12]) == 2
            # a skipped sequence number: the view can no longer trust the replica's blocks
            pub.send_multipart([b"", (seq + 5).to_bytes(8, "big"), batch(stored([13], 12))])
            for _ in range(200):
                await asyncio.sleep(0.01)
                if gaps:
                    break
            assert gaps == ["a"]
        finally:
            await subscriber.aclose()
            pub.close()
            context.term()

    asyncio.run(asyncio.wait_for(scenario(), 20))
