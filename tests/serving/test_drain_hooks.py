"""Drain hooks published in the lifespan state, registered by middleware, run in order."""

import asyncio

from serving.drain_hooks import DRAIN_HOOKS_KEY, DrainHooks, register_drain_hook


def test_hooks_are_published_registered_once_and_awaited_in_order():
    ran = []

    async def inner(scope, receive, send):
        ran.append("app")

    app = DrainHooks(inner)
    lifespan_state = {}
    asyncio.run(app({"type": "lifespan", "state": lifespan_state}, None, None))
    assert lifespan_state[DRAIN_HOOKS_KEY] is app.hooks
    request_scope = {"type": "http", "state": dict(lifespan_state)}  # what uvicorn copies

    async def guard_hook():
        ran.append("guard")

    assert register_drain_hook(request_scope, guard_hook)
    assert register_drain_hook(request_scope, guard_hook)  # once only
    assert register_drain_hook(request_scope, lambda: ran.append("other"))
    asyncio.run(app.run_hooks())
    assert ran == ["app", "guard", "other"]


def test_no_published_list_means_no_registration():
    assert not register_drain_hook({"type": "http"}, lambda: None)
    assert not register_drain_hook({"type": "http", "state": {}}, lambda: None)
