"""The wrapped app's ``/kvguard/state`` through AdmissionMiddleware: ``admitting`` is false while
the guard drains (the engine behind it still admits, and would say true)."""

import asyncio
import json

from tests.support.admission import Client, http_scope, make_guard


async def engine_app(scope, receive, send):
    """An engine's plain endpoints: its state says it admits; anything else is 404 text."""
    if scope["path"] == "/kvguard/state":
        body = json.dumps({"model": "tiny", "admitting": True, "num_in_flight": 0}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        status = 200
    else:
        body, headers, status = b"not here", [], 404
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body[:5], "more_body": True})
    await send({"type": "http.response.body", "body": body[5:], "more_body": False})


async def get(guard, path):
    client = Client(b"")
    await guard(http_scope(path, "GET"), client.receive, client.send)
    return client


def test_state_says_not_admitting_while_the_guard_drains():
    async def main():
        guard = make_guard(engine_app)
        before = await get(guard, "/kvguard/state")
        assert json.loads(before.body)["admitting"] is True
        guard.controller.begin_drain()
        during = await get(guard, "/kvguard/state")
        assert during.status == 200
        state = json.loads(during.body)
        assert state == {"model": "tiny", "admitting": False, "num_in_flight": 0}
        assert int(during.headers["content-length"]) == len(during.body)
        other = await get(guard, "/nothing")  # other answers pass unchanged
        assert other.status == 404 and other.body == b"not here"
        await guard.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
