"""The budget Lua scripts: loaded with SCRIPT LOAD, run with EVALSHA, re-loaded on NOSCRIPT.

Every tenant script is ``lua/common.lua`` followed by its own file, so the helpers (Redis
``TIME``, bucket refill, lease reaping, TTLs) are written once. A Redis that restarted or had its
script cache flushed answers NOSCRIPT; the script is loaded again and the call retried once.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["ScriptSet", "TENANT_SCRIPTS"]

TENANT_SCRIPTS = ("reserve", "settle", "renew")
_STANDALONE_SCRIPTS = ("heartbeat",)


def _read(package: str, name: str) -> str:
    return resources.files(package).joinpath("lua", f"{name}.lua").read_text("utf-8")


class ScriptSet:
    """The script bodies and their SHA1s; :meth:`call` runs one by name on a client.

    By default the budget scripts; ``package`` and ``standalone`` name another package's
    ``lua/*.lua`` scripts (no common prelude), e.g. the shared KV reservations'."""

    def __init__(self, package: str = "guard.budget",
                 standalone: tuple[str, ...] | None = None) -> None:
        if standalone is None:
            common = _read(package, "common")
            self.bodies = {name: common + "\n" + _read(package, name) for name in TENANT_SCRIPTS}
            standalone = _STANDALONE_SCRIPTS
        else:
            self.bodies = {}
        self.bodies.update({name: _read(package, name) for name in standalone})
        self.shas = {name: hashlib.sha1(body.encode("utf-8")).hexdigest()
                     for name, body in self.bodies.items()}
        self.num_reloads = 0

    async def load(self, client: Any) -> None:
        """SCRIPT LOAD every script (a Cluster client sends it to every primary)."""
        for name, body in self.bodies.items():
            sha = await client.script_load(body)
            if sha != self.shas[name]:
                raise RuntimeError(f"redis returned sha {sha} for script {name}")

    async def call(self, client: Any, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA ``name``; on NOSCRIPT load the scripts again and retry once."""
        try:
            return await client.evalsha(self.shas[name], len(keys), *keys, *args)
        except NoScriptError:
            self.num_reloads += 1
            await self.load(client)
            return await client.evalsha(self.shas[name], len(keys), *keys, *args)
