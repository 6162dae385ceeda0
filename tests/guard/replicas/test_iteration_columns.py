"""Iteration samples as columns: the stream sends them so when asked
(``/kvguard/state/stream?iterations=columns``), the guard's stream source asks for them and
hands them on as they came (rows from a replica that sends rows), the load state and the
step-time fitter take them in with the same result as rows; and the guard's fitters refit once
1 s of engine time has come, not every 32 samples of an engine that steps every 5 ms."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import pytest

from chaos.state_fleet import StateFleet, StateFleetConfig
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import StreamStateSource
from policies.step_time import StepTimeModel
from policies.step_time_fitter import StepTimeFitter
from serving.state_delta import StateDeltas, apply_delta, iteration_columns, stream_iterations

PRIOR = StepTimeModel(base_s=0.004, per_prefill_token_s=2e-6, per_decode_seq_s=2e-4,
                      per_context_token_s=1e-8)


def _samples(n: int, seed: int = 1, first_batch: int = 0, step_s: float | None = None) -> list:
    """``n`` iteration samples as an engine records them (batch ids rising)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prefill, decode = rng.choice((0, 0, 0, 512)), rng.randint(1, 64)
        context = decode * rng.randint(100, 2000)
        duration = step_s if step_s is not None else PRIOR.step_s(prefill, decode, context) \
            * rng.uniform(0.8, 1.3)
        out.append({"batch_id": first_batch + i, "num_prefill_tokens": prefill,
                    "num_decode_seqs": decode, "num_context_tokens": context,
                    "duration_s": duration, "end_s": 10.0 + i * 0.01})
    return out


def _document(samples: list, step_count: int, iterations=None) -> dict:
    """A compact ``/kvguard/state`` document with no sequences and these samples."""
    no_group = {"request_id": [], "num_output_tokens": [], "max_tokens": [],
                "num_context_tokens": [], "num_prefill_tokens_remaining": []}
    return {"block_size": 16, "num_total_blocks": 1000, "num_free_blocks": 1000,
            "max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 4096,
            "step_count": step_count, "now_s": 1.0, "running_columns": no_group,
            "waiting_columns": no_group,
            "iterations": samples if iterations is None else iterations}


# --- the encoder and the query -------------------------------------------------------------
def test_the_encoder_sends_samples_as_columns_when_asked():
    samples = _samples(30)
    encoder = StateDeltas("columns")
    full = encoder.event(_document(samples[:10], 10))["full"]
    assert full["iterations"] == iteration_columns(samples[:10])
    assert list(full["iterations"]) == list(samples[0])  # every field, in the engine's order
    delta = encoder.event(_document(samples[:25], 25))["delta"]  # 15 new ones
    assert delta["iterations"]["batch_id"] == list(range(10, 25))
    assert delta["iterations"]["duration_s"] == [s["duration_s"] for s in samples[10:25]]
    after = apply_delta(full, json.loads(json.dumps(delta)))
    assert after["iterations"] == iteration_columns(samples[10:25])
    rows = StateDeltas().event(_document(samples[:10], 10))["full"]  # the default: rows
    assert rows["iterations"] == samples[:10]


def test_samples_whose_fields_differ_stay_rows():
    samples = _samples(3)
    del samples[1]["end_s"]
    assert iteration_columns(samples) == samples
    assert iteration_columns([]) == []


@pytest.mark.parametrize("value", ["", "row", "COLUMNS", "columns,rows"])
def test_a_bad_iterations_value_is_refused(value):
    with pytest.raises(ValueError, match="iterations"):
        stream_iterations(value)
    with pytest.raises(ValueError, match="iterations"):
        StateDeltas(value)


def test_a_replica_streams_columns_over_http_when_asked_and_refuses_a_bad_value():
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002, held_running=2))  # always stepping
        await fleet.start(1)
        url = next(iter(fleet.urls.values())) + "/kvguard/state/stream?interval_ms=20"
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                bad = await client.get(url + "&iterations=col", timeout=5)
                assert bad.status_code == 400 and "iterations" in bad.json()["error"]["message"]
                got = {}
                for form in ("rows", "columns"):
                    async with client.stream("GET", url + f"&iterations={form}",
                                             timeout=5) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            event = json.loads(line[6:])
                            iterations = event.get("delta", {}).get("iterations")
                            if iterations:
                                got[form] = iterations
                                break
                return got
        finally:
            await fleet.stop()

    got = asyncio.run(main())
    assert isinstance(got["rows"], list) and isinstance(got["rows"][0], dict)
    assert isinstance(got["columns"], dict) and got["columns"]["batch_id"]
    assert len(got["columns"]["duration_s"]) == len(got["columns"]["batch_id"])


# --- the guard's stream source -------------------------------------------------------------
def test_the_stream_source_asks_for_columns():
    assert "&iterations=columns" in StreamStateSource("http://r:1").url
    assert "&iterations=columns" in StreamStateSource("http://r:1", phase=0.25).url


@pytest.mark.parametrize("form", ["rows", "columns"])
def test_the_samples_of_events_before_a_take_are_handed_on_together(form):
    """No listener: two events between takes; a replica that sends rows (one from before the
    query parameter ignores it) is read as before."""
    samples = _samples(30)
    encoder, source = StateDeltas(form), StreamStateSource("http://r")
    for n in (5, 12, 30):
        source.feed(json.loads(json.dumps(encoder.event(_document(samples[:n], n)))))
        if n == 5:
            first = source.take()["iterations"]
    both = source.take()["iterations"]
    expected = iteration_columns if form == "columns" else list
    assert first == expected(samples[:5])
    assert both == expected(samples[5:30])
    assert source.document()["iterations"] == expected(samples[12:30])  # the latest event's


def test_a_replica_that_ignores_the_query_still_feeds_the_fitter_with_rows():
    samples = _samples(40)
    load_rows, load_cols = LoadState(), LoadState()
    for load, form in ((load_rows, "rows"), (load_cols, "columns")):
        encoder, source = StateDeltas(form), StreamStateSource("http://r")
        for n in (8, 20, 40):
            source.feed(json.loads(json.dumps(encoder.event(_document(samples[:n], n)))))
            load.update_from_kvguard_state("r0", source.take(), 1.0)
    assert load_rows.fitter("r0").num_samples == load_cols.fitter("r0").num_samples == 40
    assert load_rows.step_time_model("r0") == load_cols.step_time_model("r0") != PRIOR


# --- the load state ------------------------------------------------------------------------
def test_columns_and_rows_give_the_same_fit_to_the_last_bit():
    samples = _samples(400, seed=3)
    by_rows, by_columns = LoadState(), LoadState()
    for end in range(20, 401, 37):  # documents overlap: each repeats samples already seen
        window = samples[max(0, end - 60):end]
        by_rows.update_from_kvguard_state("r0", _document(window, end), 1.0)
        by_columns.update_from_kvguard_state(
            "r0", _document(window, end, iteration_columns(window)), 1.0)
        assert by_rows.step_time_model("r0") == by_columns.step_time_model("r0")
    a, b = by_rows.fitter("r0"), by_columns.fitter("r0")
    assert a.num_samples == b.num_samples == 256  # every sample once: the repeats skipped
    assert a.prediction_error() == b.prediction_error()


def test_a_restarted_replica_s_columns_start_over():
    load = LoadState()
    load.update_from_kvguard_state("r0", _document([], 300, iteration_columns(
        _samples(40, first_batch=260))), 1.0)
    assert load.fitter("r0").num_samples == 40
    restarted = _samples(10, first_batch=0)  # its step count and batch ids start over
    load.update_from_kvguard_state("r0", _document([], 10, iteration_columns(restarted)), 2.0)
    assert load.fitter("r0").num_samples == 50


@pytest.mark.parametrize("broken", ["short", "text", "negative", "batch_text"])
def test_malformed_columns_are_refused_and_feed_nothing(broken):
    columns = iteration_columns(_samples(20))
    if broken == "short":
        columns["duration_s"].pop()
    elif broken == "text":
        columns["num_decode_seqs"][3] = "many"
    elif broken == "negative":
        columns["num_context_tokens"][5] = -1
    else:
        columns["batch_id"][-1] = "20"
    load = LoadState()
    with pytest.raises(ValueError, match="iteration columns"):
        load.update_from_kvguard_state("r0", _document([], 20, columns), 1.0)
    assert load.fitter("r0").num_samples == 0


# --- the fitter ----------------------------------------------------------------------------
def _rows(samples):
    return [(s["num_prefill_tokens"], s["num_decode_seqs"], s["num_context_tokens"],
             s["duration_s"]) for s in samples]


def test_add_columns_is_add_many():
    samples = _samples(300, seed=9)
    samples[7]["duration_s"] = math.nan  # unusable: skipped by both
    samples[8]["duration_s"] = 0.0
    samples[9].update(num_prefill_tokens=0, num_decode_seqs=0)  # an empty step
    a, b = StepTimeFitter(PRIOR), StepTimeFitter(PRIOR)
    for start in range(0, 300, 25):
        chunk = samples[start:start + 25]
        columns = iteration_columns(chunk)
        assert a.add_many(_rows(chunk)) == b.add_columns(
            columns["num_prefill_tokens"], columns["num_decode_seqs"],
            columns["num_context_tokens"], columns["duration_s"])
        assert a.model() == b.model()
    assert a.num_samples == b.num_samples == 256
    assert a.prediction_error() == b.prediction_error()


def test_add_columns_refuses_unequal_lists_and_bad_counts_adding_none():
    fitter = StepTimeFitter(PRIOR)
    with pytest.raises(ValueError, match="equal length"):
        fitter.add_columns([0, 0], [1, 2], [10, 20], [0.01])
    with pytest.raises(ValueError, match="token counts"):
        fitter.add_columns([0, 0], [1, math.inf], [10, 20], [0.01, 0.01])
    with pytest.raises(ValueError, match="token counts"):
        fitter.add_columns([0, None], [1, 2], [10, 20], [0.01, 0.01])
    assert fitter.num_samples == 0 and fitter.add_columns([], [], [], []) == 0


def test_a_refit_span_waits_for_that_much_engine_time():
    fast = StepTimeFitter(PRIOR, refit_span_s=1.0)  # 5 ms steps: 1 s is 200 of them
    for sample in _rows(_samples(16, step_s=0.005)):
        fast.add(*sample)
    first = fast.model()  # the first fit, at min_samples
    assert first != PRIOR
    rows = _rows(_samples(400, seed=2, step_s=0.005))
    fast.add_many(rows[:100])
    assert fast.model() is first  # 100 new samples, 0.5 s: still the model in use
    fast.add_many(rows[100:199])
    assert fast.model() is first  # 0.995 s
    fast.add_many(rows[199:200])
    assert fast.model() is not first  # 1 s of engine time
    slow = StepTimeFitter(PRIOR, refit_span_s=1.0)  # 40 ms steps: 32 of them pass 1 s
    for sample in _rows(_samples(16, step_s=0.04)):
        slow.add(*sample)
    first = slow.model()
    slow.add_many(_rows(_samples(31, seed=4, step_s=0.04)))
    assert slow.model() is first
    slow.add_many(_rows(_samples(1, seed=5, step_s=0.04)))
    assert slow.model() is not first  # the count, as without a span
    with pytest.raises(ValueError, match="refit_span_s"):
        StepTimeFitter(PRIOR, refit_span_s=-1.0)


def test_the_guard_s_fitters_refit_after_a_second_of_engine_time():
    load = LoadState()
    samples = _samples(600, step_s=0.005)
    load.update_from_kvguard_state("r0", _document(samples[:16], 16), 1.0)
    first = load.step_time_model("r0")
    load.update_from_kvguard_state("r0", _document(samples[:150], 150), 1.1)
    assert load.step_time_model("r0") is first  # 134 samples of 5 ms: 0.67 s
    load.update_from_kvguard_state("r0", _document(samples[:216], 216), 1.2)
    assert load.step_time_model("r0") is not first  # 200: 1 s


@pytest.mark.parametrize("how", ["add", "add_columns"])
def test_records_waiting_for_the_next_fit_leave_no_object_for_the_collector(how):
    """Python's cyclic collector runs after every 700 net allocations of objects it tracks: a
    tuple per waiting record (200 a second per replica stepping every 5 ms) was what set it
    off at 256 streamed replicas, to walk objects that were never garbage."""
    import gc

    fitter = StepTimeFitter(PRIOR, window=1024)
    fitter.add_many(_rows(_samples(16)))
    fitter.model()  # fitted: the records below wait for the next fit
    rows = _rows(_samples(300, seed=6))
    columns = [list(column) for column in zip(*rows, strict=True)]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        if how == "add":
            for row in rows:
                fitter.add(*row)
        else:
            fitter.add_columns(*columns)
        grown = gc.get_count()[0] - before
    finally:
        if was_enabled:
            gc.enable()
    assert fitter.num_samples == 316
    assert grown < 10  # a few lists at most, not one object per record


def test_samples_that_change_form_within_a_stream_end_it():
    """A replica sends one form for a stream's life; two forms between takes are a malformed
    stream (a new one follows, whose full document starts the samples over)."""
    from guard.replicas.state_stream import StreamGap

    samples = _samples(20)
    source = StreamStateSource("http://r")
    source.feed(StateDeltas("columns").event(_document(samples[:5], 5)))
    rows = StateDeltas()
    rows.event(_document(samples[:5], 5))
    with pytest.raises(StreamGap, match="changed form"):
        source.feed(rows.event(_document(samples[:12], 12)))
