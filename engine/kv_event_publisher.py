"""Publishes KV-cache event batches on a ZMQ PUB socket, framed as vLLM frames them.

Each batch is one multipart message ``[topic, seq, payload]``: ``topic`` the UTF-8 topic
(default empty, as vLLM's), ``seq`` an 8-byte big-endian counter starting at 0 (a subscriber
that sees a gap knows it missed batches), ``payload`` the msgpack ``KVEventBatch``
(``engine.kv_events``). The engine binds the endpoint (``tcp://127.0.0.1:5557``; a port of
``*`` picks a free one) and subscribers connect to it; ``endpoint`` is the address actually
bound, which the engine advertises in ``/kvguard/state``. A PUB socket never blocks: a
subscriber too slow for the high-water mark loses batches, and sees the gap in ``seq``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.kv_events import KVCacheEvent, encode_batch

__all__ = ["KVEventPublisher"]

DEFAULT_SEND_HWM = 100_000


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "",
                 clock: Callable[[], float] = time.time, send_hwm: int = DEFAULT_SEND_HWM) -> None:
        import zmq

        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv events endpoint must be tcp://, ipc:// or inproc://, got "
                             f"{endpoint!r}")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, send_hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind kv events endpoint {endpoint!r}: {exc}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._clock = clock
        self._next_seq = 0

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (one caller at a time: the engine calls it under its lock)."""
        payload = encode_batch(self._clock(), events)
        self._socket.send_multipart([self._topic, self._next_seq.to_bytes(8, "big"), payload])
        self._next_seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
