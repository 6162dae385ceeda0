"""Per-token delivery records in the engine trace, streamed through the guarded engine over
real loopback HTTP (``kvguard engine --model tiny --guard ... --trace ...``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_helpers import start_engine, wait_until

from guard import cli
from guard.observe import timeline
from guard.observe.token_gaps import request_gaps

MAX_TOKENS = [5, 7, 9, 11, 6, 8]


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, int]:
    body = {"prompt": [20 + i, 21, 22, 23], "max_tokens": MAX_TOKENS[i], "ignore_eos": True,
            "stream": True}
    num_tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                num_tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
        return resp.headers["x-request-id"], num_tokens


async def _all_streams(url: str) -> list[tuple[str, int]]:
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
        return await asyncio.gather(*(_stream(client, url, i) for i in range(len(MAX_TOKENS))))


def _lines(path) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {x["request_id"]: x for x in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_every_streamed_token_has_a_complete_ordered_delivery_record(tmp_path, capsys):
    guard_trace, engine_trace = tmp_path / "guard.jsonl", tmp_path / "engine.jsonl"
    config = tmp_path / "guard.toml"
    config.write_text(f'policy = "always-admit"\ntrace_path = "{guard_trace}"\n')
    with start_engine(["--model", "tiny", "--device", "cpu", "--guard", str(config),
                       "--trace", str(engine_trace)]) as eng:
        streams = asyncio.run(_all_streams(eng.base_url))
        plain = httpx.post(eng.base_url + "/v1/completions", timeout=30, trust_env=False,
                           json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert plain.status_code == 200
        ids = [rid for rid, _ in streams] + [plain.headers["x-request-id"]]
        lines = wait_until(lambda: (lambda x: x if set(ids) <= set(x) else None)(
            _lines(engine_trace)), 10.0)
    assert lines is not None, "the engine trace lacks some requests"
    assert [n for _, n in streams] == MAX_TOKENS  # the client saw every token
    for request_id, num_tokens in streams:
        line = lines[request_id]
        records = line["tokens"]
        assert len(records) == num_tokens == line["num_output_tokens"]
        step_ends = dict(line["iterations"])
        for batch_id, start_s, end_s, handed_s, written_s in records:
            assert None not in (start_s, end_s, handed_s, written_s)
            assert start_s <= end_s <= handed_s <= written_s
            assert end_s <= step_ends[batch_id]  # a step this request took part in
        batch_ids = [r[0] for r in records]
        assert batch_ids == sorted(set(batch_ids))  # one token per step, in step order
        written = [r[4] for r in records]
        assert written == sorted(written)
        assert line["first_byte_s"] <= records[0][4] <= line["completion_s"]
        for gap in request_gaps(line):  # the parts add up to each gap exactly
            assert sum(gap.parts_s[k] for k in ("step", "between_steps", "loop", "write")) \
                == pytest.approx(gap.gap_s, abs=1e-9)
    assert lines[plain.headers["x-request-id"]]["tokens"] is None  # not streamed
    assert cli.main(["timeline", str(guard_trace), str(engine_trace), "--json"]) == 0
    delivery = json.loads(capsys.readouterr().out)["delivery"]
    assert delivery["stages"]["write"]["n"] == sum(MAX_TOKENS)
    assert delivery["num_gaps"] == sum(MAX_TOKENS) - len(MAX_TOKENS)
    guard, engine = timeline.load_traces([str(guard_trace), str(engine_trace)])
    assert set(ids) <= set(guard) & set(engine)
    relayed = 0  # the guard runs in-process (one clock): handed <= forwarded <= written
    for request_id, _ in streams:
        chunks, records = guard[request_id]["chunks_s"], engine[request_id]["tokens"]
        assert guard[request_id]["itl_limit_s"] == 0.08
        assert chunks == sorted(chunks) and len(chunks) <= len(records)
        if len(chunks) == len(records):  # every token's chunk carried text
            relayed += 1
            assert all(r[3] <= c <= r[4] for r, c in zip(records, chunks, strict=True))
    assert relayed >= 1
    assert len(guard[plain.headers["x-request-id"]]["chunks_s"]) == 1  # the whole answer
