"""The wrapped app's ``/kvguard/state`` as the in-process guard's clients see it.

While :class:`~guard.middleware.AdmissionMiddleware` drains, the engine behind it still admits
(it drains only after the guard, so that it never refuses a request the guard let in), and its
state page would say ``"admitting": true``. Whoever reads the page (a proxy's poller, an
operator, a load balancer) asks whether this server takes new requests: it does not.
:func:`not_admitting` wraps the ``send`` of that one response and sets ``admitting`` to false in
its JSON object; any other answer (an error, not JSON) passes unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["STATE_PATH", "not_admitting"]

STATE_PATH = "/kvguard/state"

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


def not_admitting(send: Send) -> Send:
    """``send`` for one ``/kvguard/state`` response, with ``"admitting": false`` in its body."""
    start: Message | None = None
    chunks: list[bytes] = []

    async def wrapped(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = _rewritten(b"".join(chunks)) if start["status"] == 200 else None
        if body is None:
            body = b"".join(chunks)
        else:
            headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
            start = {**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return wrapped


def _rewritten(body: bytes) -> bytes | None:
    try:
        state = json.loads(body)
    except ValueError:
        return None
    if not isinstance(state, dict):
        return None
    state["admitting"] = False
    return json.dumps(state).encode()
