"""Which replica holds the hottest prefix: asked of the replicas themselves.

The ``cache-loss`` scenario kills the replica holding the hottest prefixes of a shared-prefix
load. Which one that is depends on the routing, so it is found out when the fault strikes:
each replica is sent the hottest prefix (``prefix-0``, rank 0 of the Zipf popularity) with one
question token and ``max_tokens`` 1, and reports in ``usage.prompt_tokens_details.
cached_tokens`` how much of it it had cached; the one with the most holds it (ties: the
lowest index). Four one-token requests, straight to the replicas (not through a guard).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import httpx

from chaos.records import RequestSpec
from chaos.schedule import prompt_token_ids

__all__ = ["hot_replica_probe"]


def hot_replica_probe(replica_urls: Callable[[], Sequence[str]], seed: int, prefix_tokens: int,
                      model: str | None = None, timeout_s: float = 10.0
                      ) -> Callable[[], Awaitable[int]]:
    """An async callable giving the index of the replica with the most of ``prefix-0``
    cached (0 when none answers)."""
    probe = RequestSpec(0, 0.0, prefix_tokens + 1, 1, "interactive", "probe",
                        prompt_parts=(("prefix-0", prefix_tokens), ("hot-probe", 1)))
    prompt = prompt_token_ids(seed, probe)

    async def hottest() -> int:
        best, best_cached = 0, -1
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            for index, url in enumerate(replica_urls()):
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                if model is not None:
                    body["model"] = model
                try:
                    response = await client.post(url.rstrip("/") + "/v1/completions", json=body)
                    usage = response.json().get("usage") or {}
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                except (httpx.HTTPError, ValueError, AttributeError):
                    continue
                if isinstance(cached, int) and cached > best_cached:
                    best, best_cached = index, cached
        return best

    return hottest
