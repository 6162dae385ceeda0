"""Three real guard processes sharing one Redis: budgets hold across them, and through a dead
Redis. Real HTTP on loopback, real redis-server, processes ended by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_servers import RedisServer, free_port

from guard.budget.keys import tenant_keys

pytestmark = pytest.mark.slow

SERVER = Path(__file__).with_name("guarded_server.py")
PROMPT_TOKENS, MAX_TOKENS = 10, 20  # usage: 10 prompt + 5 completion (guarded_server.py)
BODY = {"model": "m", "prompt": "x" * 40, "max_tokens": MAX_TOKENS}


def write_config(path: Path, redis_url: str, tenant_limits: str,
                 redis_timeout_s: float = 0.05) -> Path:
    path.write_text(f"""
policy = "always-admit"
redis_url = "{redis_url}"
initial_chars_per_token = 4.0
[budget]
heartbeat_s = 0.2
lease_s = 10.0
retry_max_s = 0.3
redis_timeout_s = {redis_timeout_s}
[[tenants]]
name = "acme"
api_key = "k-acme"
{tenant_limits}
""")
    return path


class Guards:
    """N guard processes on free ports with one config."""

    def __init__(self, config: Path, num: int = 3, hold_s: float = 4.0) -> None:
        self._env = {**os.environ, "KVGUARD_CONFIG": str(config)}
        self._hold_s = hold_s
        self.ports = [free_port() for _ in range(num)]
        self.procs = [self._spawn(p) for p in self.ports]
        self._started = False  # every guard has answered once

    def _spawn(self, port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SERVER), str(port), str(self._hold_s)],
                                env=self._env)

    def _respawn_if_unbound(self, i: int) -> None:
        """Another process on this shared machine may take a free port before the guard binds
        it: start that guard again on a fresh port (before any traffic)."""
        if not self._started and self.procs[i].poll() is not None:
            self.ports[i] = free_port()
            self.procs[i] = self._spawn(self.ports[i])

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def backend(self, url: str) -> str | None:
        try:
            text = httpx.get(url + "/kvguard/metrics", timeout=2.0, trust_env=False).text
        except httpx.HTTPError:
            return None
        for name in ("redis", "local"):
            if f'kvguard_budget_backend{{backend="{name}"}} 1.0' in text:
                return name
        return None

    def wait_backend(self, wanted: str, timeout_s: float = 60.0) -> None:
        """Wait until every guard enforces on ``wanted``; an anonymous request (no budget of
        its own) first starts each guard's store."""
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.ports)):
            while True:
                try:
                    httpx.post(self.urls()[i] + "/v1/completions", json=BODY, timeout=10.0,
                               trust_env=False)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, f"{self.urls()[i]} never answered"
                    self._respawn_if_unbound(i)
                    time.sleep(0.1)
        self._started = True
        while not all(self.backend(u) == wanted for u in self.urls()):
            assert all(p.poll() is None for p in self.procs), "a guard exited"
            assert time.monotonic() < deadline, f"guards not on {wanted}"
            time.sleep(0.1)

    def remaining_requests(self, url: str) -> float | None:
        """The guard's ``kvguard_budget_remaining_requests`` for acme (None: not exported)."""
        try:
            text = httpx.get(url + "/kvguard/metrics", timeout=2.0, trust_env=False).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith('kvguard_budget_remaining_requests{tenant="acme"}'):
                return float(line.split()[-1])
        return None

    def wait_remaining_requests(self, ok, timeout_s: float = 30.0) -> list[float]:
        """Wait until every guard's view of acme's remaining requests satisfies ``ok``."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = [self.remaining_requests(u) for u in self.urls()]
            if all(v is not None and ok(v) for v in seen):
                return seen
            assert time.monotonic() < deadline, f"remaining requests seen: {seen}"
            time.sleep(0.05)

    def release(self) -> None:
        """End every tenant request the guards' app is holding (SIGUSR1, guarded_server.py)."""
        for proc in self.procs:
            proc.send_signal(signal.SIGUSR1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def burst(urls: list[str], num: int, on_progress=None) -> list[int]:
    """``num`` simultaneous completions spread round-robin over ``urls``: their statuses."""
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60.0, limits=limits, trust_env=False) as client:
        async def one(i: int) -> int:
            response = await client.post(urls[i % len(urls)] + "/v1/completions", json=BODY,
                                         headers={"authorization": "Bearer k-acme"})
            return response.status_code
        tasks = [asyncio.ensure_future(one(i)) for i in range(num)]
        if on_progress is not None:
            await on_progress(tasks)
        return list(await asyncio.gather(*tasks))


async def settled_in_flight(tasks, quiet_s: float = 1.0, timeout_s: float = 60.0) -> int:
    """Wait until the denials have all come back (nothing finishes for ``quiet_s``): the number
    still in flight (the admitted, held by the app)."""
    deadline = time.monotonic() + timeout_s
    done, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_done = sum(t.done() for t in tasks)
        if now_done != done or not done:
            done, stable_since = now_done, time.monotonic()
        elif time.monotonic() - stable_since >= quiet_s:
            return len(tasks) - done
        await asyncio.sleep(0.05)
    raise AssertionError("requests never settled")


@pytest.fixture
def redis_for_guards():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()


def _refill(per_minute: int, elapsed_s: float) -> int:
    return int(per_minute * elapsed_s / 60) + 1


@pytest.mark.parametrize("variant", ["requests", "tokens"])
def test_three_guards_admit_no_more_than_the_budget(tmp_path, redis_for_guards, variant):
    server = redis_for_guards
    per_request = PROMPT_TOKENS + MAX_TOKENS
    limit = ("requests_per_minute = 100" if variant == "requests"
             else f"tokens_per_minute = {100 * per_request}")
    # 300 simultaneous requests on 3 guard processes sharing 2 busy cores: their event loops
    # lag far past 50 ms, which the breaker would read as a slow Redis and switch to the local
    # share. This test is about enforcement with Redis up, so it allows 1 s.
    guards = Guards(write_config(tmp_path / "guard.toml", server.url, limit, redis_timeout_s=1.0),
                    hold_s=8.0)
    grants_key = tenant_keys("acme")[2]
    try:
        guards.wait_backend("redis")
        seen = {}

        async def check_in_flight(tasks):
            seen["in_flight"] = await settled_in_flight(tasks)
            seen["reservations"] = int(server.cli("hlen", grants_key))
            guards.release()  # the admitted were held (at most hold_s) only for this count

        start_s = time.monotonic()
        statuses = asyncio.run(burst(guards.urls(), 300, check_in_flight))
        elapsed_s = time.monotonic() - start_s
        admitted = statuses.count(200)
        assert set(statuses) <= {200, 429}
        # zero over-admission: the budget plus what refilled while the burst ran
        assert 90 <= admitted <= 100 + _refill(100, elapsed_s)
        assert seen["reservations"] == seen["in_flight"] == admitted  # Redis held exactly these
        time.sleep(0.5)  # settles are batched for 20 ms
        assert int(server.cli("exists", grants_key)) == 0
        if variant == "tokens":  # each completion used 15 of its 30 reserved tokens: refunded
            level = float(server.cli("hget", tenant_keys("acme")[0], "tl"))
            used = 100 * per_request - admitted * 15
            assert used - 1 <= level <= used + _refill(100 * per_request, time.monotonic() - start_s)
    finally:
        guards.stop()


def test_redis_killed_mid_window_local_share_then_back_on_redis(tmp_path, redis_for_guards):
    server = redis_for_guards
    guards = Guards(write_config(tmp_path / "guard.toml", server.url, "requests_per_minute = 100"),
                    hold_s=0.1)
    try:
        guards.wait_backend("redis")
        start_s = time.monotonic()
        assert asyncio.run(burst(guards.urls(), 80)).count(200) == 80  # 80 % of the window
        # every guard has heard from Redis that about 20 are left (settle replies, heartbeats)
        left = guards.wait_remaining_requests(lambda v: v <= 20 + _refill(100, time.monotonic()
                                                                          - start_s))
        server.kill()
        kill_s = time.monotonic()
        outage = asyncio.run(burst(guards.urls(), 300))
        assert not [s for s in outage if s >= 500]
        # the local shares: each guard's third of what was left, plus a third of the refill
        local_share_bound = max(left) + _refill(100, time.monotonic() - kill_s)
        assert outage.count(200) <= 1.1 * local_share_bound
        guards.wait_backend("local")
        server.start()  # empty: no keys, no scripts, a full bucket
        guards.wait_backend("redis")
        after = asyncio.run(burst(guards.urls(), 30))
        assert set(after) <= {200, 429} and int(server.cli("exists", tenant_keys("acme")[0])) == 1
        # the guards charged the fresh bucket what the window had spent: no new window
        spent = 80 + outage.count(200) + after.count(200)
        assert spent <= 1.1 * 100 + _refill(100, time.monotonic() - start_s)
    finally:
        guards.stop()


def test_redis_hung_guards_keep_answering_then_sigcont_brings_redis_back(tmp_path,
                                                                        redis_for_guards):
    server = redis_for_guards
    guards = Guards(write_config(tmp_path / "guard.toml", server.url, "requests_per_minute = 1000"),
                    hold_s=0.1)
    try:
        guards.wait_backend("redis")
        server.signal(signal.SIGSTOP)  # hung: connections open, nothing answers
        try:
            hung = asyncio.run(burst(guards.urls(), 60))
            assert hung.count(200) == 60  # served on the local share, nobody stuck on Redis
            guards.wait_backend("local")
        finally:
            server.signal(signal.SIGCONT)
        guards.wait_backend("redis")
        assert asyncio.run(burst(guards.urls(), 30)).count(200) == 30
    finally:
        guards.stop()
