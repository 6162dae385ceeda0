"""End to end over loopback: users on the official OpenAI Python SDK (default ``max_retries=2``,
which honours ``x-should-retry`` and ``retry-after-ms``) at ~2x the capacity of a
``kvguard engine --backend sim`` replica with the guard mounted.

With ``slo`` the retry budget turns sheds into "do not retry" once retries would pass 10 % of
first attempts, so users make at most ~1.1 upstream attempts each; with ``always-admit`` the
engine's own queue grows until users run out of patience (each gives its call
``USER_PATIENCE_S`` in all, retries included). Only relations that do not depend on machine speed
are asserted.
"""

import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cpu_heavy, pytest.mark.timeout(240)]

CAPACITY_RPS = 4.3  # 8 slots, ~1.9 s per request at this time scale (as test_e2e_sim)
NUM_USERS = 60  # ~7 s of arrivals: always-admit's backlog grows ~3 s past the patience
USER_PATIENCE_S = 4.0  # a served request takes ~1.9 s; always-admit's queue passes 4 s
ENGINE_ARGS = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
               "--time-scale", "20", "--max-num-seqs", "8"]


async def _user(client: openai.AsyncOpenAI, index: int, start_s: float) -> str:
    await asyncio.sleep(max(0.0, start_s - time.monotonic()))
    try:
        async with asyncio.timeout(USER_PATIENCE_S):
            stream = await client.completions.create(
                model="llama-7b", prompt=[7] * 64, max_tokens=16, stream=True,
                extra_body={"ignore_eos": True}, extra_headers={"x-test-user": str(index)})
            async for _ in stream:
                pass
        return "answered"
    except (TimeoutError, openai.APITimeoutError):
        return "timed_out"
    except openai.APIStatusError as exc:
        return f"status_{exc.status_code}"
    except openai.APIConnectionError:
        return "connection_error"


async def _offer(base_url: str) -> tuple[Counter, Counter]:
    attempts: Counter = Counter()

    async def count(request):
        attempts[request.headers.get("x-test-user")] += 1

    rng = random.Random(5)
    http = httpx2.AsyncClient(event_hooks={"request": [count]}, trust_env=False,
                              limits=httpx2.Limits(max_connections=4 * NUM_USERS))
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="test", http_client=http,
                                  timeout=USER_PATIENCE_S) as client:
        t_s, starts = time.monotonic() + 0.2, []
        for _ in range(NUM_USERS):
            starts.append(t_s)
            t_s += rng.expovariate(2 * CAPACITY_RPS)
        outcomes = await asyncio.gather(*(_user(client, i, s) for i, s in enumerate(starts)))
    return Counter(outcomes), attempts


def _run(policy: str, tmp_path: Path) -> tuple[Counter, float]:
    config = tmp_path / f"{policy}.toml"
    config.write_text(f'policy = "{policy}"\nrefresh_interval_s = 0.05\n'
                      "[classes.interactive]\nttft_s = 1.0\nitl_s = 0.5\n")
    with start_engine([*ENGINE_ARGS, "--guard", str(config)]) as eng:
        outcomes, attempts = asyncio.run(_offer(eng.base_url))
    assert len(attempts) == NUM_USERS and sum(outcomes.values()) == NUM_USERS
    return outcomes, sum(attempts.values()) / NUM_USERS


def test_sdk_users_stop_retrying_at_the_guard_while_always_admit_times_them_out(tmp_path):
    slo, slo_attempts = _run("slo", tmp_path)
    always, always_attempts = _run("always-admit", tmp_path)
    print(f"slo: {dict(slo)}, {slo_attempts:.2f} attempts/user; "
          f"always-admit: {dict(always)}, {always_attempts:.2f} attempts/user")
    assert slo_attempts <= 1.2
    assert slo["answered"] >= NUM_USERS // 4  # it still serves: shedding is not refusing all
    assert slo.get("status_503", 0) > 0  # 2x capacity: some users were told no, and stopped
    assert always.get("timed_out", 0) > slo.get("timed_out", 0)  # the queue outgrew patience
