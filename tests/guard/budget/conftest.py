"""Budget test fixtures: one real redis-server and one 3-master Redis Cluster per session."""

from __future__ import annotations

import pytest
from redis_servers import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_cluster():
    cluster = RedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.kill()
