"""A Redis client for a URL, single server or Cluster (detected from the server).

A single server on a plain ``redis://`` URL gets the budget store's own pipelined client
(:class:`~guard.budget.resp_client.RespClient`: it spends less CPU per call than redis-py, see
its docstring); a Cluster,
or a URL with TLS, a unix socket or options, gets ``redis.asyncio`` (``RedisCluster`` for a
Cluster). Short socket and connect timeouts (the guard never waits on Redis longer than
``timeout_s``); no client-side retries: the breaker in :mod:`guard.budget.fallback` decides what
happens next.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from guard.budget.resp_client import RespClient, supports

__all__ = ["connect"]


async def connect(url: str, timeout_s: float) -> Any:
    """Connect to ``url``; a server with ``cluster_enabled:1`` gets a RedisCluster client.

    Raises the client's exception when the server cannot be reached.
    """
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                   decode_responses=True)
    if supports(url):
        client: Any = RespClient.from_url(url, timeout_s)
    else:
        client = aioredis.Redis.from_url(url, retry_on_timeout=False, **options)
    try:
        info = await client.info("cluster")
    except BaseException:
        await client.aclose()
        raise
    if not int(info.get("cluster_enabled", 0)):
        return client
    await client.aclose()
    cluster = RedisCluster.from_url(url, **options)
    try:
        await cluster.initialize()
    except BaseException:
        await cluster.aclose()
        raise
    return cluster
