"""KV-cache events: vLLM's msgpack layout, and a real ZMQ subscriber on loopback receiving what
an engine publishes (in-process, and from a ``kvguard engine`` process found via its state)."""

from __future__ import annotations

import random

import httpx
import msgpack
import pytest
import zmq
from server_helpers import start_engine, wait_until

from engine.block_hash import prefix_block_hashes
from engine.kv_event_publisher import KVEventPublisher
from engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_the_wire_layout_is_vllms_array_like_tagged_structs():
    events = [BlockStored((1, 2), None, tuple(range(8)), 4), BlockRemoved((1,)),
              AllBlocksCleared()]
    raw = msgpack.unpackb(encode_batch(12.5, events))
    assert raw == [12.5, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"],
                          ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0]
    assert decode_batch(encode_batch(12.5, events)) == (12.5, events)
    big = BlockStored((2**64 - 1,), 2**63, (1, 2), 2)  # hashes are unsigned 64-bit
    assert decode_batch(encode_batch(0.0, [big]))[1] == [big]


def test_a_payload_that_is_not_a_batch_is_a_value_error():
    for payload in (b"\xc1", msgpack.packb([1.0, [["Nope"]]]), msgpack.packb({"a": 1})):
        with pytest.raises(ValueError, match="not a KV event batch"):
            decode_batch(payload)


def test_a_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="tcp://"):
        KVEventPublisher("127.0.0.1:5557")


def _subscriber(context: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _receive(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[bytes, int, list]] | None:
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)[1]


def test_an_engine_publishes_stored_and_removed_blocks_to_a_zmq_subscriber():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    context = zmq.Context()
    sub = _subscriber(context, publisher.endpoint, b"kv")
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        # PUB drops what it sends before the subscription arrives: probe until one gets through
        for _ in range(100):
            publisher.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        else:
            pytest.fail("the subscriber never received a probe")
        while sub.poll(100):
            sub.recv_multipart()
        engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=4)
        engine.attach_kv_event_sink(publisher.publish, publisher.endpoint)
        assert engine.state()["kv_events_endpoint"] == publisher.endpoint
        prompts = [[300 + i for i in range(40)], [900 + i for i in range(40)]]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        received = []
        while (message := _receive(sub)) is not None:
            received.append(message)
            if any(isinstance(e, BlockRemoved) for e in message[2]):
                break
        topics, seqs, batches = zip(*received, strict=True)
        assert set(topics) == {b"kv"} and list(seqs) == list(range(seqs[0], seqs[0] + len(seqs)))
        events = [e for batch in batches for e in batch]
        first, second = (prefix_block_hashes(p, 16, "tiny") for p in prompts)
        assert events[0] == BlockStored(tuple(first), None, tuple(prompts[0][:32]), 16)
        # free queue 3 2 1 0 (the first request's table 0 1 2 freed tail first): the second
        # prompt's 3 blocks take 3, 2 and 1, evicting the first prompt's second block only
        assert events[1:] == [BlockRemoved((first[1],)),
                              BlockStored(tuple(second), None, tuple(prompts[1][:32]), 16)]
    finally:
        sub.close()
        context.term()
        publisher.close()


def test_replay_sends_buffered_batches_from_the_requested_seq_then_the_end_marker():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                 buffer_batches=3)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)  # a REQ socket would take only the first reply
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(5):  # nobody subscribed: PUB drops them, the buffer keeps the last 3
            publisher.publish([BlockRemoved((i,))])
        dealer.connect(publisher.replay_endpoint)
        replies = []
        for start in (3, 0):
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            batch = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if not payload:
                    assert int.from_bytes(seq, "big", signed=True) == -1
                    break
                batch.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
            replies.append(batch)
        assert replies[0] == [(3, [BlockRemoved((3,))]), (4, [BlockRemoved((4,))])]
        assert [seq for seq, _ in replies[1]] == [2, 3, 4]  # 0 and 1 left the buffer
    finally:
        dealer.close()
        context.term()
        publisher.close()


@pytest.mark.slow
def test_kvguard_engine_advertises_its_endpoint_and_publishes_there():
    args = ["--model", "tiny", "--device", "cpu", "--num-blocks", "64",
            "--kv-events-endpoint", "tcp://127.0.0.1:*",
            "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    with start_engine(args) as eng:
        state = httpx.get(eng.base_url + "/kvguard/state", timeout=5.0).json()
        endpoint = state["kv_events_endpoint"]
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith("*")
        replay = state["kv_events_replay_endpoint"]
        assert replay.startswith("tcp://127.0.0.1:") and replay != endpoint
        context = zmq.Context()
        sub = _subscriber(context, endpoint)
        try:
            rng = random.Random(3)

            def one_request_seen() -> list | None:
                prompt = [rng.randrange(300, 40000) for _ in range(20)]
                resp = httpx.post(eng.base_url + "/v1/completions",
                                  json={"prompt": prompt, "max_tokens": 1}, timeout=30.0)
                assert resp.status_code == 200
                message = _receive(sub, timeout_ms=200)
                return None if message is None else [prompt, message]

            seen = wait_until(one_request_seen, timeout_s=20.0)
            assert seen is not None, eng.output()
            prompt, (_, _, events) = seen
            assert events == [BlockStored(tuple(prefix_block_hashes(prompt, 16, "tiny")), None,
                                          tuple(prompt[:16]), 16)]
        finally:
            sub.close()
            context.term()


def test_prefix_caching_flag_reaches_the_engine():
    import argparse

    from engine.server_cli import _build_engine, _kv_event_publisher, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    for flags, expected in (([], True), (["--no-enable-prefix-caching"], False)):
        args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--num-blocks", "8",
                                  *flags])
        assert _build_engine(args).state()["enable_prefix_caching"] is expected
    lone_replay = parser.parse_args(["--model", "tiny", "--kv-events-replay-endpoint",
                                      "tcp://127.0.0.1:*"])
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        _kv_event_publisher(lone_replay, engine=None)
    sim = parser.parse_args(["--model", "llama-7b", "--backend", "sim",
                             "--no-enable-prefix-caching", "--num-blocks", "64"])
    assert _build_engine(sim).block_manager.enable_prefix_caching is False
