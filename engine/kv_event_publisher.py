"""Publishes KV-cache event batches on a ZMQ PUB socket, framed as vLLM frames them.

Each batch is one multipart message ``[topic, seq, payload]``: ``topic`` the UTF-8 topic
(default empty, as vLLM's), ``seq`` an 8-byte big-endian counter starting at 0 (a subscriber
that sees a gap knows it missed batches), ``payload`` the msgpack ``KVEventBatch``
(``engine.kv_events``). The engine binds the endpoint (``tcp://127.0.0.1:5557``; a port of
``*`` picks a free one) and subscribers connect to it; ``endpoint`` is the address actually
bound, which the engine advertises in ``/kvguard/state``. A PUB socket never blocks: a
subscriber too slow for the high-water mark loses batches, and sees the gap in ``seq``.

Replay (optional, as vLLM's): a ROUTER socket at ``replay_endpoint`` answers a client that
sends a start ``seq`` (8 bytes big-endian) after an empty delimiter frame with every buffered
batch from there on, one ``[b"", seq, payload]`` message each, then
``[b"", -1 (8 bytes, signed), b""]``. Read them with a DEALER socket: a REQ socket takes only
the first reply to each request. The last ``buffer_batches``
batches are kept; a small thread serves replay requests.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from engine.kv_events import KVCacheEvent, encode_batch

__all__ = ["KVEventPublisher"]

DEFAULT_SEND_HWM = 100_000
DEFAULT_BUFFER_BATCHES = 10_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_REPLAY_POLL_MS = 100


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 clock: Callable[[], float] = time.time, send_hwm: int = DEFAULT_SEND_HWM,
                 buffer_batches: int = DEFAULT_BUFFER_BATCHES) -> None:
        import zmq

        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events {name} must be tcp://, ipc:// or inproc://, got "
                                 f"{value!r}")
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {buffer_batches}")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, send_hwm)
        self._replay = None if replay_endpoint is None else self._context.socket(zmq.ROUTER)
        self._sockets = [s for s in (self._socket, self._replay) if s is not None]
        for sock in self._sockets:
            sock.setsockopt(zmq.LINGER, 0)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self._socket.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind kv events endpoint: {exc}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (None if self._replay is None
                                else self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        self._topic = topic.encode()
        self._clock = clock
        self._next_seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_batches)
        self._buffer_lock = threading.Lock()
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay",
                                            daemon=True)
            self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (one caller at a time: the engine calls it under its lock)."""
        payload = encode_batch(self._clock(), events)
        seq = self._next_seq
        self._socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._next_seq += 1
        if self._replay is not None:
            with self._buffer_lock:
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._replay.poll(_REPLAY_POLL_MS):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # not a REQ client's [identity, b"", start]: ignore it
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._buffer_lock:
                batches = [(s, p) for s, p in self._buffer if s >= start_seq]
            for seq, payload in batches:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sock in self._sockets:
            sock.close(linger=0)
        self._context.term()
