"""A replica's fit of its own step time on its state stream (``fit=1``): no samples on the
wire, the fit in ``set`` only when it changed, one fit shared by a replica's streams, the
guard's model the replica's, a bad fit refused with nothing changed, and a replica from
before the parameter still read (real HTTP over loopback)."""

from __future__ import annotations

import asyncio
import json
import math
from urllib.parse import parse_qs

import pytest

from chaos.state_fleet import _ReplicaApp
from chaos.state_replica import StateReplica
from engine.compact_state import compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import StreamStateSource
from policies.step_time import StepTimeModel
from policies.step_time_fitter import prior_from_timing_model, replica_fitter
from serving.state_delta import StateDeltas, serve_state_stream, stream_fit
from serving.step_time_fit import FIT_FIELDS, StepTimeFit, fitted_model
from tests.support.loopback import LoopbackServer


def _docs(num: int = 80, step_s: float = 0.05) -> list[dict]:
    """Compact documents of a state-only replica decoding a few sequences, one every
    ``step_s`` (each with a handful of new iteration samples)."""
    replica = StateReplica(lambda p, d, c: 0.004 + 3e-6 * p + 2e-4 * d + 1e-7 * c,
                           num_total_blocks=800, max_num_seqs=8, max_num_batched_tokens=512)
    docs, now_s = [], 0.0
    for i in range(num):
        if i % 5 == 0:
            replica.submit(f"q{i}", 50 + 7 * i, 40, lambda n, done: None, now_s)
        now_s += step_s
        replica.advance_to(now_s)
        docs.append(compact_state(replica.state()))
    return docs


def _wire(event: dict) -> dict:
    return json.loads(json.dumps(event, separators=(",", ":")))


def test_events_carry_the_fit_instead_of_samples_and_only_when_it_changed():
    docs = _docs()
    encoder = StateDeltas("columns", StepTimeFit())
    events = [_wire(encoder.event(doc)) for doc in docs]
    assert "iterations" not in events[0]["full"] or not events[0]["full"]["iterations"]
    assert all("iterations" not in e.get("delta", {}) for e in events[1:])
    fits = [events[0]["full"]["step_time_fit"]] + [
        e["delta"]["set"]["step_time_fit"] for e in events[1:]
        if "step_time_fit" in e["delta"].get("set", {})]
    # the prior, then a fit at each refit: distinct, and far fewer than the events
    assert 3 <= len(fits) < len(events) // 3
    assert all(a != b for a, b in zip(fits, fits[1:], strict=False))
    assert set(fits[0]) == {*FIT_FIELDS, "num_samples"}
    # the samples it replaced: most of a columns stream's bytes
    columns = StateDeltas("columns")
    plain = sum(len(json.dumps(columns.event(doc))) for doc in docs[1:])
    assert sum(len(json.dumps(e)) for e in events[1:]) < plain / 2


def test_the_published_fit_is_the_guards_own_fit_of_the_same_samples():
    """A guard's fitter fed each document's new samples (what a columns stream hands it)
    makes, after every event, the model the replica published: to the last bit."""
    docs = _docs()
    fit, guard = StepTimeFit(), None
    last = -1
    for doc in docs:
        published = _wire({"f": fit.update(doc)})["f"]
        if guard is None:
            guard = replica_fitter(prior_from_timing_model(doc.get("timing_model"),
                                                           doc.get("time_scale", 1.0))
                                   or fitted_model(published))
        new = [it for it in doc["iterations"] if it["batch_id"] > last]
        if new:
            last = new[-1]["batch_id"]
        guard.add_many((it["num_prefill_tokens"], it["num_decode_seqs"],
                        it["num_context_tokens"], it["duration_s"]) for it in new)
        assert fitted_model(published) == guard.model()
    assert fitted_model(published) != guard.prior  # it fitted


def test_streams_of_one_replica_share_its_fit():
    docs = _docs(40)
    fit = StepTimeFit()
    a, b = StateDeltas("columns", fit), StateDeltas("rows", fit)
    for doc in docs:
        ea, eb = a.event(doc), b.event(doc)
        body_a = ea.get("full") or ea["delta"].get("set", {})
        body_b = eb.get("full") or eb["delta"].get("set", {})
        assert body_a.get("step_time_fit") == body_b.get("step_time_fit")
    alone = StepTimeFit()
    for doc in docs:
        alone.update(doc)
    # each sample fed once, however many streams read the documents
    assert fit.update(docs[-1])["num_samples"] == alone.update(docs[-1])["num_samples"]
    assert fit.update(docs[-1]) == alone.update(docs[-1])


def test_a_restarted_engine_has_its_samples_fed_again():
    docs = _docs(30)
    fit = StepTimeFit()
    for doc in docs:
        fit.update(doc)
    before = fit._fitter._num_added
    restarted = {**docs[5], "step_count": 1}  # ids start over: its samples are new ones
    fit.update(restarted)
    assert fit._fitter._num_added == before + sum(
        1 for it in restarted["iterations"] if it["num_decode_seqs"] or it["num_prefill_tokens"])


@pytest.mark.parametrize("bad", [
    None, [], "fast", {}, {"base_s": 0.01},
    {"base_s": -1.0, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
     "per_context_token_s": 0.0},
    {"base_s": math.nan, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
     "per_context_token_s": 0.0},
    {"base_s": math.inf, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
     "per_context_token_s": 0.0},
    {"base_s": True, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
     "per_context_token_s": 0.0},
    {"base_s": "0.01", "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
     "per_context_token_s": 0.0},
])
def test_a_bad_fit_is_refused_and_changes_nothing(bad):
    with pytest.raises(ValueError, match="step_time_fit"):
        fitted_model(bad)
    if bad is None:  # in a document, null is no fit: the guard fits the samples itself
        return
    docs = _docs(30)
    good = {**docs[-1], "step_time_fit": StepTimeFit().update(docs[-1])}
    load = LoadState()
    load.update_from_kvguard_state("r0", good, 1.0)
    before, model = load.snapshot(1.0), load.step_time_model("r0")
    with pytest.raises(ValueError, match="step_time_fit"):
        load.update_from_kvguard_state("r0", {**docs[-2], "step_time_fit": bad}, 1.0)
    assert load.snapshot(1.0) == before and load.step_time_model("r0") == model
    with pytest.raises(ValueError, match="step_time_fit"):  # nor a replica new to it
        load.update_from_kvguard_state("r1", {**docs[-2], "step_time_fit": bad}, 1.0)
    assert [r.replica_id for r in load.snapshot(1.0).replicas] == ["r0"]


@pytest.mark.parametrize("value, wanted", [(None, False), ("0", False), ("1", True)])
def test_the_fit_query_value(value, wanted):
    assert stream_fit(value) is wanted


@pytest.mark.parametrize("value", ["2", "yes", "true", "01"])
def test_a_bad_fit_query_value_is_a_400(value):
    assert "fit" in str(pytest.raises(ValueError, stream_fit, value).value)
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "query_string": f"interval_ms=100&fit={value}".encode()}
    asyncio.run(serve_state_stream(scope, receive, send, lambda: {}))
    assert sent[0]["status"] == 400 and b"fit" in sent[1]["body"]


def _replica_app(honours_fit: bool):
    """An ASGI state-only replica (its samples every 10 ms of its own clock); without
    ``honours_fit`` it drops ``fit`` from the query (a replica from before the parameter)."""
    clock = [0.0]
    replica = StateReplica(lambda p, d, c: 0.004 + 2e-4 * d, num_total_blocks=800,
                           max_num_seqs=8, max_num_batched_tokens=512)
    for i in range(4):
        replica.submit(f"q{i}", 100, 3000, lambda n, done: None, 0.0)
    inner = _ReplicaApp(replica, lambda: clock[0], lambda: None)
    queries: list[dict] = []

    def compact() -> dict:
        clock[0] += 0.05  # each event: 50 ms more of the replica's own time
        replica.advance_to(clock[0])
        return inner._compact()

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/kvguard/state/stream":
            query = parse_qs(scope["query_string"].decode())
            queries.append(query)
            if not honours_fit:
                scope = {**scope, "query_string": b"interval_ms=10&iterations=columns"}
            return await serve_state_stream(scope, receive, send, compact,
                                            fit=inner.step_time_fit)
        await inner(scope, receive, send)

    return app, inner, queries


@pytest.mark.parametrize("honours_fit", [True, False])
def test_the_guard_reads_a_replicas_fit_over_http_and_fits_an_old_one_itself(honours_fit):
    app, inner, queries = _replica_app(honours_fit)
    load = LoadState()
    documents = []

    async def main(url):
        source = StreamStateSource(url, interval_ms=10)
        source.listen(lambda payload: (documents.append(payload),
                                       load.update_from_kvguard_state("r0", payload, 1.0)))
        try:
            assert await source.opened(5.0) is None
            for _ in range(1000):  # bounded: until the model moved from its prior
                if len(documents) > 40 and load.step_time_model("r0") != \
                        load.fitter("r0").prior:
                    break
                await asyncio.sleep(0.01)
        finally:
            await source.aclose()

    with LoopbackServer(app) as server:
        asyncio.run(asyncio.wait_for(main(server.url), 30))
    assert queries[0]["fit"] == ["1"]
    model = load.step_time_model("r0")
    assert model != load.fitter("r0").prior
    if honours_fit:  # the replica's own fit, taken as published; no sample came
        assert not any(d["iterations"] for d in documents)
        assert model == fitted_model(documents[-1]["step_time_fit"])
        assert load.fitter("r0").num_samples == 0
    else:  # samples, fitted by the guard
        assert any(d["iterations"] for d in documents)
        assert all("step_time_fit" not in d for d in documents)
        assert load.fitter("r0").num_samples > 16
    assert isinstance(model, StepTimeModel)
