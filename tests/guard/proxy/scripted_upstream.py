"""An upstream that answers each request with the bytes a test scripts for it, recording every
request it read (its request-target exactly as received), on its own loop in a thread.

    with ScriptedUpstream(lambda target: ok_json(b"{}")) as upstream:
        ...  # upstream.url; upstream.targets: the targets received, in order

``answer(target)`` returns the bytes to write (then the connection stays open for the next
request), ``(bytes, True)`` to write them and close, or None to close the connection without
a byte of answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["ScriptedUpstream", "ok_json", "sse_burst"]


def ok_json(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra +
            b"content-length: %d\r\n\r\n" % len(body) + body)


def sse_burst(num_bytes: int) -> bytes:
    """A chunked SSE completion stream of about ``num_bytes``, meant to be written at once."""
    event = (b'data: {"id":"c","object":"text_completion","model":"fake-model",'
             b'"choices":[{"index":0,"text":"' + b"x" * 400 + b'"}]}\n\n')
    events = [event] * (num_bytes // len(event) + 1) + [b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")


class ScriptedUpstream:
    def __init__(self, answer: Callable[[bytes], bytes | tuple[bytes, bool] | None]) -> None:
        self.answer = answer
        self.targets: list[bytes] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> ScriptedUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                self.targets.append(target)
                reply = self.answer(target)
                if reply is None:
                    return
                close = isinstance(reply, tuple)
                writer.write(reply[0] if close else reply)
                await writer.drain()
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
