"""``GET /kvguard/state?compact=1`` on a sim replica over loopback: sequences as columns, only
the iteration samples after ``since_batch``, and a clear 400 for a malformed one."""

from __future__ import annotations

import threading

import httpx
from server_helpers import start_engine, wait_until

from engine.compact_state import SEQUENCE_COLUMNS

SIM_ARGS = ["--backend", "sim", "--model", "llama-7b", "--gpu", "h100-80g", "--time-scale", "1"]


def test_compact_state_over_http():
    with start_engine(SIM_ARGS) as eng:
        url = eng.base_url + "/kvguard/state"
        body = {"model": "llama-7b", "prompt": list(range(300, 340)), "max_tokens": 400,
                "ignore_eos": True}
        threads = [threading.Thread(target=httpx.post, args=(eng.base_url + "/v1/completions",),
                                    kwargs={"json": body, "timeout": 60.0}) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(httpx.get(url).json()["running"]) == 3, timeout_s=30.0)
        compact = httpx.get(url, params={"compact": "1"}).json()
        columns = compact["running_columns"]
        assert set(columns) == set(SEQUENCE_COLUMNS) and "running" not in compact
        assert all(len(columns[name]) == 3 for name in SEQUENCE_COLUMNS)
        assert columns["max_tokens"] == [400, 400, 400]
        newest = compact["iterations"][-1]["batch_id"]
        since = httpx.get(url, params={"compact": "1", "since_batch": str(newest)}).json()
        assert all(it["batch_id"] > newest for it in since["iterations"])
        bad = httpx.get(url, params={"compact": "1", "since_batch": "x"})
        assert bad.status_code == 400 and "since_batch" in bad.json()["error"]["message"]
        for t in threads:
            t.join(timeout=60.0)
