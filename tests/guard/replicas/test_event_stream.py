"""The state stream's bytes parsed in ``data_received`` (:class:`EventStreamProtocol`): the
same events however the bytes are split, and every way a stream ends — bad bytes, its last
chunk, EOF, a refusal, silence, a failing callback — ends it once, with why, and aborts the
connection, never raising into the loop. The protocol is fed bytes by hand, with a stand-in
transport."""

from __future__ import annotations

import asyncio

import pytest

from guard.replicas.event_stream import EventStreamProtocol

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")
HEAD_UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


def chunk(payload: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(payload), extension, payload)


# events as the server sends them, one a chunk, and as chunks cut them otherwise
BODY = [b'data: {"seq": 0, "full": {}}\n\n', b'data: {"seq": 1}\n\n',
        b': a comment only\n\n', b'data: {"a": 1}\ndata: {"b": 2}\nid: 9\n\n']
EVENTS = [[b'{"seq": 0, "full": {}}'], [b'{"seq": 1}'], [], [b'{"a": 1}', b'{"b": 2}']]
CHUNKED = HEAD + b"".join(chunk(e) for e in BODY) + chunk(b'data: {"sp', b";x=y") \
    + chunk(b'lit": 1}\n\ndata: {"two": 2}\n\n')
CHUNKED_EVENTS = EVENTS + [[b'{"split": 1}'], [b'{"two": 2}']]


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.num_aborts = 0

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.num_aborts += 1


class Fed:
    """A protocol on a stand-in transport and what it handed over."""

    def __init__(self, *, on_event=None, head_timeout_s: float = 30.0,  # noqa: ANN001
                 silent_after_s: float = 30.0) -> None:
        self.events: list[list[bytes]] = []
        self.num_opens = 0
        self.transport = Transport()
        self.protocol = EventStreamProtocol(
            b"GET /s HTTP/1.1\r\n\r\n", self._opened, on_event or self.events.append,
            head_timeout_s=head_timeout_s, silent_after_s=silent_after_s)
        self.protocol.connection_made(self.transport)

    def _opened(self) -> None:
        self.num_opens += 1

    def feed(self, *pieces: bytes) -> Fed:
        for piece in pieces:
            self.protocol.data_received(piece)
        return self

    @property
    def why(self) -> BaseException | None:
        return self.protocol.ended.result() if self.protocol.ended.done() else None

    def close(self) -> None:  # the connection goes: its timer with it
        self.protocol.connection_lost(None)


def run(body):  # noqa: ANN001, ANN201 - a test's coroutine, run on a loop of its own
    return asyncio.run(asyncio.wait_for(body(), 30))


def test_every_split_of_the_bytes_gives_the_same_events():
    async def main():
        one = Fed().feed(CHUNKED)
        assert one.transport.written == [b"GET /s HTTP/1.1\r\n\r\n"]
        assert (one.events, one.num_opens, one.why) == (CHUNKED_EVENTS, 1, None)
        one.close()
        for cut in range(len(CHUNKED) + 1):  # at every byte: the head, size lines, CRLFs
            fed = Fed().feed(CHUNKED[:cut], CHUNKED[cut:])
            assert (fed.events, fed.num_opens, fed.why) == (CHUNKED_EVENTS, 1, None), cut
            fed.close()
        bytewise = Fed().feed(*(CHUNKED[i:i + 1] for i in range(len(CHUNKED))))
        assert (bytewise.events, bytewise.why) == (CHUNKED_EVENTS, None)
        bytewise.close()

    run(main)


def test_an_event_is_handed_over_only_once_its_blank_line_came():
    async def main():
        fed = Fed().feed(HEAD, chunk(b'data: {"seq": 0}\n'))
        assert fed.events == []
        fed.feed(chunk(b"\n"))
        assert fed.events == [[b'{"seq": 0}']]
        fed.close()

    run(main)


def test_a_body_until_close_ends_at_eof_and_an_event_cut_by_it_is_dropped():
    async def main():
        fed = Fed().feed(HEAD_UNTIL_CLOSE + b"".join(BODY) + b'data: {"cut')
        assert (fed.events, fed.why) == (EVENTS, None)
        assert fed.protocol.eof_received() is None  # the transport closes itself
        fed.protocol.connection_lost(None)
        assert fed.events == EVENTS and isinstance(fed.why, ConnectionError)
        fed.feed(b'": 1}\n\n')  # nothing is read after the end
        assert fed.events == EVENTS

    run(main)


def test_the_last_chunk_ends_the_stream():
    async def main():
        fed = Fed().feed(HEAD, chunk(BODY[0]), b"0\r\n\r\n", chunk(BODY[1]))
        assert fed.events == EVENTS[:1]
        assert isinstance(fed.why, ConnectionError) and "last chunk" in str(fed.why)
        assert fed.transport.num_aborts == 1

    run(main)


@pytest.mark.parametrize("bad", [b"zz\r\n", b"-1\r\n", b"0x10\r\n", b"1_0\r\n",
                                 b"3\r\nabcXY", b"7" * 5000])
def test_bad_chunk_framing_ends_the_stream_with_an_error(bad):
    async def main():
        fed = Fed().feed(HEAD, chunk(BODY[0]), bad, chunk(BODY[1]))  # no raise into the loop
        assert fed.events == EVENTS[:1]
        assert isinstance(fed.why, ValueError) and fed.transport.num_aborts == 1

    run(main)


@pytest.mark.parametrize("head", [b"garbage\r\n\r\n", b"HTTP/1.1 2000 OK\r\n\r\n",
                                  b"HTTP/1.1\r\n\r\n", b"SSH-2.0-x 200\r\n\r\n",
                                  b"HTTP/1.1 200 OK" + b"x" * 70000])
def test_a_malformed_head_ends_the_stream_with_an_error(head):
    async def main():
        fed = Fed().feed(head, chunk(BODY[0]))
        assert fed.protocol.status is None and fed.events == [] and fed.num_opens == 0
        assert isinstance(fed.why, ValueError) and fed.transport.num_aborts == 1

    run(main)


@pytest.mark.parametrize("status", [404, 503, 301])
def test_a_head_other_than_200_ends_the_stream_and_says_its_status(status):
    async def main():
        fed = Fed().feed(b"HTTP/1.1 %d Nope\r\ncontent-length: 2\r\n\r\n{}" % status)
        assert fed.protocol.status == status and fed.num_opens == 0 and fed.events == []
        assert isinstance(fed.why, ConnectionError) and str(status) in str(fed.why)
        assert fed.transport.num_aborts == 1

    run(main)


def test_a_callback_that_raises_ends_the_stream_with_its_exception():
    def on_event(payloads):  # noqa: ANN001, ANN202
        raise KeyError("bad event")

    async def main():
        fed = Fed(on_event=on_event).feed(HEAD, chunk(BODY[0]))  # no raise into the loop
        assert isinstance(fed.why, KeyError) and fed.transport.num_aborts == 1

    run(main)


def test_the_first_end_is_the_one_kept():
    async def main():
        fed = Fed().feed(HEAD, b"zz\r\n")
        fed.protocol.connection_lost(ConnectionResetError("reset"))
        assert isinstance(fed.why, ValueError)

    run(main)


def test_silence_past_the_bound_ends_the_stream():
    async def main():
        fed = Fed(silent_after_s=0.05).feed(HEAD, chunk(BODY[0]))
        why = await asyncio.wait_for(asyncio.shield(fed.protocol.ended), 10)
        assert isinstance(why, TimeoutError) and "no bytes for 0.05 s" in str(why)
        assert fed.events == EVENTS[:1] and fed.transport.num_aborts == 1

    run(main)


def test_no_head_within_its_bound_ends_the_stream():
    async def main():
        fed = Fed(head_timeout_s=0.05).feed(b"HTTP/1.1 200")
        why = await asyncio.wait_for(asyncio.shield(fed.protocol.ended), 10)
        assert isinstance(why, TimeoutError) and "no head" in str(why)

    run(main)


def test_the_timer_only_ends_a_stream_whose_latest_bytes_are_past_the_bound():
    """When the timer fires it compares the latest bytes' time with the bound: within it, it
    is set again for them plus the bound (no timer per read), past it, the stream ends."""
    async def main():
        loop = asyncio.get_running_loop()
        fed = Fed(silent_after_s=5.0).feed(HEAD, chunk(BODY[0]))
        protocol = fed.protocol
        first = protocol._timer
        protocol._last_s = loop.time() - 4.0  # bytes 4 s ago
        protocol._check()
        assert fed.why is None and protocol._timer is not first
        assert protocol._timer.when() == pytest.approx(protocol._last_s + 5.0)
        protocol._last_s = loop.time() - 5.0  # 5 s ago: past the bound
        protocol._check()
        assert isinstance(fed.why, TimeoutError) and fed.transport.num_aborts == 1

    run(main)
