"""``make_user_client``: the user client for a client kind (the SDK one imported only when asked).

Kept apart from :mod:`chaos.clients` because the SDK client builds on that module.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp

from chaos.clients import ClientConfig, EntryPicker, HttpUserClient

__all__ = ["make_user_client"]


def make_user_client(cfg: ClientConfig, http: aiohttp.ClientSession, entries: EntryPicker, *,
                     model: str | None, class_header: str = "x-kvguard-class",
                     clock: Callable[[], float] = time.monotonic):
    """The client for ``cfg.kind`` (the SDK one is imported only when asked for)."""
    if cfg.kind == "sdk":
        from chaos.sdk_client import SdkUserClient
        return SdkUserClient(cfg, entries, model=model, class_header=class_header, clock=clock)
    return HttpUserClient(cfg, http, entries, model=model, class_header=class_header,
                          clock=clock)
