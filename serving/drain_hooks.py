"""Drain hooks: how a server lets in-process middleware stop admitting before it drains.

A server publishes a list under ``scope["state"]["kvguard.drain_hooks"]`` (the ASGI lifespan
state, which every request's scope shares). Middleware that admits requests appends a callable
to it (at lifespan startup or on its first request). On SIGTERM the server runs every hook,
awaiting those that return an awaitable, and only then drains itself: the guard answers 503
``shutting_down`` to new and queued requests while the streams it admitted finish, so the
engine behind it never refuses a request the guard let in.

    app = DrainHooks(app)                   # outermost, around the middleware stack
    ...on SIGTERM: await app.run_hooks()    # then drain the engine
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["DRAIN_HOOKS_KEY", "DrainHooks", "register_drain_hook"]

DRAIN_HOOKS_KEY = "kvguard.drain_hooks"


def register_drain_hook(scope: dict, hook: Callable[[], Any]) -> bool:
    """Append ``hook`` to the drain hooks a server published in ``scope["state"]`` (once);
    False when the server publishes none."""
    hooks = (scope.get("state") or {}).get(DRAIN_HOOKS_KEY)
    if not isinstance(hooks, list):
        return False
    if hook not in hooks:
        hooks.append(hook)
    return True


class DrainHooks:
    """Pure ASGI wrapper that publishes the hook list in the lifespan state."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.hooks: list[Callable[[], Any]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" and isinstance(scope.get("state"), dict):
            scope["state"][DRAIN_HOOKS_KEY] = self.hooks
        await self.app(scope, receive, send)

    async def run_hooks(self) -> None:
        """Run every registered hook in order (awaiting the awaitable ones)."""
        for hook in list(self.hooks):
            result = hook()
            if inspect.isawaitable(result):
                await result
