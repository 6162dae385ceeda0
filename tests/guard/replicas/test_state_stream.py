"""The streamed state (``/kvguard/state/stream``: a full compact document, then deltas) gives
the guard exactly the documents, snapshots and decisions that polling full documents gives on
a recorded trace; a lost delta and a restarted replica each make the guard start a new stream
(a full resync)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import pytest

from chaos.state_fleet import StateFleet, StateFleetConfig
from chaos.state_replica import StateReplica
from chaos.topology import Topology, TopologySpec
from engine.compact_state import compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import UNCHANGED, StreamGap, StreamStateSource
from policies.slo import SloPolicy
from serving.state_delta import StateDeltas, apply_delta, iteration_columns, stream_interval_s
from serving.step_time_fit import StepTimeFit
from tests.policies.policy_builders import make_cost


def _trace(seed: int = 7, num_steps: int = 120, step_s: float = 0.05) -> list[dict]:
    """Full ``/kvguard/state`` documents of a state-only replica under random arrivals, one
    every ``step_s``: sequences arrive, prefill in chunks, decode, wait for blocks, end."""
    rng = random.Random(seed)
    replica = StateReplica(lambda p, d, c: 0.004 + 2e-6 * p + 2e-4 * d, num_total_blocks=600,
                           max_num_seqs=12, max_num_batched_tokens=512)
    docs, now_s = [], 0.0
    for step in range(num_steps):
        for i in range(rng.choice((0, 1, 2, 4, 6))):
            replica.submit(f"q{step}-{i}", rng.randint(20, 900), rng.randint(1, 120),
                           lambda n, done: None, now_s)
        if step % 17 == 5 and replica.running:  # a client goes away mid-stream
            replica.abort(rng.choice(replica.running).request_id)
        now_s += step_s
        replica.advance_to(now_s)
        docs.append(replica.state())
    return docs


def _streamed(docs: list[dict], iterations: str = "rows") -> list[dict]:
    """What a stream reader holds after each event of ``docs``' stream (its iteration samples
    sent as ``iterations``: rows or columns)."""
    encoder, source, out = StateDeltas(iterations), StreamStateSource("http://r"), []
    for doc in docs:
        event = json.loads(json.dumps(encoder.event(compact_state(doc))))  # over the wire
        source.feed(event)
        out.append(source.document())
    return out


@pytest.mark.parametrize("iterations", ["rows", "columns"])
def test_deltas_rebuild_every_document_of_a_recorded_trace(iterations):
    docs = _trace()
    assert max(len(d["running"]) for d in docs) >= 10 and any(d["waiting"] for d in docs)
    last_batch = None
    num_samples = 0
    for doc, streamed in zip(docs, _streamed(docs, iterations), strict=True):
        expected = compact_state(doc, last_batch)
        if expected["iterations"]:
            last_batch = expected["iterations"][-1]["batch_id"]
            num_samples += len(expected["iterations"])
            if iterations == "columns":  # one list per field, the i-th entries one sample
                expected["iterations"] = iteration_columns(expected["iterations"])
                assert list(expected["iterations"]) == list(doc["iterations"][0])
        assert streamed == expected
    assert num_samples > 100


def test_deltas_carry_only_what_changed():
    from chaos.bench.scale import fleet_document

    before = fleet_document(0, 256)
    after = json.loads(json.dumps(before))
    for seq in after["running"]:  # three decode steps for every running sequence
        seq["num_output_tokens"] += 3
        seq["num_context_tokens"] += 3
    after["running"][7]["max_tokens"] = 999  # and one that changed otherwise
    after["num_free_blocks"] -= 20
    encoder = StateDeltas()
    full = encoder.event(compact_state(before))
    delta = encoder.event(compact_state(after))
    assert delta["delta"]["advance"] == 3
    assert delta["delta"]["running"]["upsert"]["request_id"] == ["r0-7"]
    assert len(json.dumps(delta)) < 400 < 20 * 400 < len(json.dumps(full))
    steady = StateDeltas()
    steady.event(compact_state(after))
    assert steady.event(compact_state(after)) == {"seq": 1, "delta": {}}


def test_a_reordered_group_and_a_preempted_sequence_come_through():
    from chaos.bench.scale import fleet_document

    before = compact_state(fleet_document(4, 8))
    after = compact_state(fleet_document(4, 8))
    running = after["running_columns"]
    for name in running:  # the first running sequence is preempted: back to the waiting front
        after["waiting_columns"][name].insert(0, running[name].pop(0))
        running[name].reverse()  # and the engine reordered the rest
    after["num_free_blocks"] += 14
    encoder = StateDeltas()
    encoder.event(before)
    event = encoder.event(after)
    assert "order" in event["delta"]["running"] and "order" in event["delta"]["waiting"]
    assert apply_delta(before, event["delta"]) == {**after, "iterations": []}


_OTHER = _trace(seed=3, num_steps=40)[-1]  # a second replica, steady


@pytest.mark.parametrize("iterations", ["rows", "columns", "fit"])
def test_the_streamed_view_decides_as_the_full_documents_do(iterations):
    """The guard fed what the stream source hands the poller (groups kept in O(changes),
    the guard's own requests corrected; the iteration samples as rows or as columns, or none
    but the replica's fit of them) against the guard fed every compact document: the same
    snapshots, step-time fits included (the replica's fit is the guard's, to the last bit)."""
    docs = _trace(seed=11)
    polled, streamed = LoadState(), LoadState()
    encoder = StateDeltas("columns", StepTimeFit()) if iterations == "fit" \
        else StateDeltas(iterations)
    source = StreamStateSource("http://r")
    policy = SloPolicy()
    num_admitted = 0
    for step, doc in enumerate(docs):
        now_s = 0.05 * (step + 1)
        source.feed(json.loads(json.dumps(encoder.event(compact_state(doc)))))
        polled.update_from_kvguard_state("r0", compact_state(doc), now_s)
        streamed.update_from_kvguard_state("r0", source.take(), now_s)
        for load in (polled, streamed):
            load.update_from_kvguard_state("r1", compact_state(_OTHER), now_s)
        a, b = polled.snapshot(now_s), streamed.snapshot(now_s)
        assert [r.load for r in a.replicas] == [r.load for r in b.replicas]
        assert a.replicas == b.replicas and a.step_time == b.step_time
        assert polled.step_time_model("r0") == streamed.step_time_model("r0")
        for i in range(3):
            # ids the replica lists from the next step on: the guard's own requests there
            cost = make_cost(f"q{step + 1}-{i}", prompt=100 + 300 * i, max_tokens=64,
                             arrival_s=now_s)
            decision = policy.decide(cost, a)
            assert decision == SloPolicy().decide(cost, b)
            if hasattr(decision, "replica_id"):
                num_admitted += 1
                for load in (polled, streamed):
                    load.reserve(decision.replica_id, cost.request_id, cost, now_s)
    reported = [r for r in streamed._reservations.values() if r.reported]
    assert num_admitted >= 6 and reported  # some of its own requests were listed, priced as its
    assert streamed.step_time_model("r0") != streamed.fitter("r0").prior  # fitted, alike


def test_rows_decoded_past_their_max_tokens_are_summed_as_the_documents_sum_them():
    """A decoding row that the advance carries past its ``max_tokens`` (an engine stops it
    there; the bench's synthetic fleet does not) has no output left: the streamed group's
    sums are the documents' then too (they kept counting its output as still to come)."""
    from chaos.bench.scale import stream_events

    source, streamed = StreamStateSource("http://r"), LoadState()
    num_past = 0
    for event in stream_events(1, 40, 36):
        source.feed(json.loads(event))
        base = streamed.update_from_kvguard_state("r0", source.take(), 1.0)
        doc = source.document()
        polled = LoadState().update_from_kvguard_state("r0", doc, 1.0)
        assert base.load == polled.load
        columns = doc["running_columns"]
        num_past += sum(o > m for o, m in zip(columns["num_output_tokens"],
                                              columns["max_tokens"], strict=True))
    assert num_past >= 20


def test_a_group_that_churns_keeps_its_sums_and_a_bounded_heap():
    """Rows come and go, most before their max_tokens, some carried past it: the sums stay
    the documents' and the entries rows leave behind are bounded by the rows there are."""
    from guard.replicas.documents import _column_group
    from guard.replicas.stream_view import StreamGroup
    from policies.replica_load import SeqTotals

    rng = random.Random(5)
    group = StreamGroup(16, advances=True)
    for i in range(3000):
        group.set(f"q{i}", rng.randint(0, 20), rng.choice((24, 60, 400)),
                  rng.randint(1, 900), rng.choice((0, 0, 0, 64)))
        if i >= 40:
            group.remove(f"q{i - 40}")
        group.step(rng.randint(0, 3))
        if i % 97 == 0:
            captured = group.capture()
            totals = captured.totals(lambda rid: None, set(), 512, _column_group)
            expected = SeqTotals.of(tuple(totals.seqs), 16, 512)
            assert (totals.num_context_tokens, totals.num_prefill_tokens,
                    totals.num_committed_blocks) == (expected.num_context_tokens,
                                                     expected.num_prefill_tokens,
                                                     expected.num_committed_blocks)
        assert len(group._past_max) <= 2 * len(group.rows) + 33


def test_captures_keep_their_rows_and_an_advance_copies_none():
    """A capture shares its group's rows until the group next changes a row: every capture
    taken along a churning group still gives the rows of its time at the end, and captures
    with only decode steps between them hold the same dict (no copy per event)."""
    from guard.replicas.stream_view import StreamGroup

    rng = random.Random(11)
    group = StreamGroup(16, advances=True)
    kept = []
    for i in range(400):
        if rng.random() < 0.5:
            group.set(f"q{i}", rng.randint(0, 20), rng.choice((None, 60, 400)),
                      rng.randint(1, 900), rng.choice((0, 0, 64)))
        if i >= 10 and rng.random() < 0.3 and group.rows:
            group.remove(rng.choice(sorted(group.rows)))
        if rng.random() < 0.1 and group.rows:
            order = list(group.rows)
            rng.shuffle(order)
            group.reorder(order)
        group.step(rng.randint(0, 3))
        capture = group.capture()
        kept.append((capture, capture.rows()))
        advanced = group.capture()
        group.step(2)
        again = group.capture()
        assert again._rows is advanced._rows  # steps alone: the same dict, not a copy
        assert [(r[0], r[1] + 2 * (not r[4]), r[2], r[3] + 2 * (not r[4]), r[4])
                for r in advanced.rows()] == again.rows()
    assert all(capture.rows() == rows for capture, rows in kept)


def test_an_event_out_of_sequence_is_a_gap():
    docs = _trace(num_steps=5)
    encoder = StateDeltas()
    events = [encoder.event(compact_state(d)) for d in docs]
    source = StreamStateSource("http://r")
    source.feed(events[0])
    source.feed(events[1])
    with pytest.raises(StreamGap):
        source.feed(events[3])  # events[2] was lost
    assert source.num_gaps == 1
    with pytest.raises(StreamGap):
        StreamStateSource("http://r").feed(events[1])  # a delta before any full document


def test_a_heartbeat_only_marks_the_view_fresh():
    docs = _trace(num_steps=30)
    encoder, source, load = StateDeltas(), StreamStateSource("http://r"), LoadState()
    source.feed(encoder.event(compact_state(docs[-1])))
    load.update_from_kvguard_state("r0", source.take(), 1.0)
    before = load.replica_snapshot("r0")
    later = {**docs[-1], "now_s": docs[-1]["now_s"] + 0.1}  # only the replica's clock moved
    source.feed(json.loads(json.dumps(encoder.event(compact_state(later)))))
    assert source.take() is UNCHANGED
    load.mark_unhealthy("r0", 1.5)
    load.touch("r0", 2.0)
    after = load.replica_snapshot("r0")
    assert after.observed_s == 2.0 and after.healthy and after.load == before.load
    assert source.take() is None  # and nothing since


@pytest.mark.parametrize("value", ["0", "9", "5001", "x", "-1", "1e3"])
def test_a_bad_interval_is_refused(value):
    with pytest.raises(ValueError, match="interval_ms"):
        stream_interval_s(value)


async def _dropping_relay(upstream_port: int, drop_event: int):
    """A loopback TCP relay that forwards everything but the ``drop_event``-th SSE event of
    the first connection's response (one delta lost on the wire)."""
    connections = []

    async def handle(reader, writer):
        index = len(connections)
        connections.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)

        async def client_to_upstream():
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()

        async def upstream_to_client():
            buffered, num_events = b"", 0
            with contextlib.suppress(Exception):
                while data := await up_reader.read(65536):
                    if index != 0:
                        writer.write(data)
                        await writer.drain()
                        continue
                    buffered += data
                    out = b""
                    while (end := buffered.find(b"data: ")) >= 0 and \
                            (stop := buffered.find(b"\n\n", end)) >= 0:
                        event = buffered[:stop + 2]
                        buffered = buffered[stop + 2:]
                        num_events += 1
                        if num_events == drop_event:  # keep the chunk framing: blank it
                            event = event[:end] + b": lost" + b" " * (len(event) - end - 8) \
                                + b"\n\n"
                        out += event
                    writer.write(out)
                    await writer.drain()
            writer.close()

        await asyncio.gather(client_to_upstream(), upstream_to_client())

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("reader", ["raw", "httpx"])
def test_a_lost_delta_on_the_wire_makes_the_guard_resync(reader):
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        port = int(fleet.urls["replica-0"].rsplit(":", 1)[1])
        relay, relay_port = await _dropping_relay(port, drop_event=4)
        own = httpx.AsyncClient(trust_env=False) if reader == "httpx" else None
        source = StreamStateSource(f"http://127.0.0.1:{relay_port}", interval_ms=20, client=own)
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                body = {"model": "llama-7b", "prompt": list(range(50)), "max_tokens": 400}
                work = [asyncio.ensure_future(client.post(
                    fleet.urls["replica-0"] + "/v1/completions", json=body)) for _ in range(3)]
                for _ in range(200):
                    with contextlib.suppress(ConnectionError):
                        await source.fetch()
                    if source.num_resyncs and source.document() is not None:
                        break
                    await asyncio.sleep(0.02)
                assert source.num_gaps == 1 and source.num_resyncs == 1
                await asyncio.sleep(0.1)
                doc = source.document()
                expected = compact_state(fleet._served["replica-0"].replica.state())
                assert doc["running_columns"]["request_id"] == \
                    expected["running_columns"]["request_id"]
                for task in work:
                    task.cancel()
        finally:
            await source.aclose()
            if own is not None:
                await own.aclose()
            relay.close()
            await fleet.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.slow
def test_a_restarted_replica_makes_the_guard_resync():
    with Topology(TopologySpec(num_replicas=1, num_proxies=0)) as fleet:
        url = fleet.replica_urls[0]

        async def until(predicate, source):
            for _ in range(400):
                with contextlib.suppress(Exception):
                    await source.fetch()
                if predicate():
                    return
                await asyncio.sleep(0.025)
            raise AssertionError("timed out")

        async def main():
            source = StreamStateSource(url, interval_ms=50)
            try:
                await until(lambda: source.document() is not None, source)
                async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                    await client.post(url + "/v1/completions",
                                      json={"model": "llama-7b", "prompt": "hi", "max_tokens": 8})
                await until(lambda: source.document()["step_count"] > 0, source)
                steps_before = source.document()["step_count"]
                await asyncio.to_thread(fleet.restart_replicas)
                await until(lambda: source.num_resyncs >= 1 and source.document() is not None
                            and source.document()["step_count"] < steps_before, source)
            finally:
                await source.aclose()

        asyncio.run(asyncio.wait_for(main(), 120))


def test_events_reach_the_guard_as_they_arrive_not_at_the_next_round():
    from guard.replicas.poller import StatePoller

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        source = StreamStateSource(fleet.urls["replica-0"], interval_ms=20)
        load = LoadState()
        poller = StatePoller(load, {"r0": source}, interval_s=60.0)  # no round in this test
        try:
            with contextlib.suppress(ConnectionError):
                await source.fetch()  # starts the stream
            for _ in range(100):
                await asyncio.sleep(0.02)
                if source.num_events >= 5:
                    break
            snap = load.replica_snapshot("r0")
            assert snap is not None and snap.capacity_known and poller.num_refreshes == 0
            first_s = snap.observed_s
            await asyncio.sleep(0.1)
            assert load.replica_snapshot("r0").observed_s > first_s  # touched by heartbeats
        finally:
            await poller.stop()
            await fleet.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.slow
def test_a_draining_engine_ends_its_streams():
    """SIGTERM: the engine stops admitting and its state streams end, so an open stream does
    not hold its shutdown (the guard's source then resyncs, and finds no replica)."""
    with Topology(TopologySpec(num_replicas=1, num_proxies=0)) as fleet:
        child = fleet.replicas[0]

        async def main():
            source = StreamStateSource(fleet.replica_urls[0], interval_ms=50)
            try:
                with contextlib.suppress(Exception):
                    await source.fetch()
                for _ in range(200):
                    if source.num_events >= 3:
                        break
                    await asyncio.sleep(0.02)
                start_s = time.monotonic()
                child.terminate(timeout_s=20)
                return time.monotonic() - start_s
            finally:
                await source.aclose()

        assert asyncio.run(asyncio.wait_for(main(), 60)) < 5.0  # the graceful wait is 10 s


def test_aclose_ends_a_reader_that_swallowed_a_cancellation():
    """asyncio.wait_for (Python 3.11) can swallow a cancellation that meets a read just done;
    the reader then reads on, and aclose must still end it."""

    async def main():
        source = StreamStateSource("http://127.0.0.1:9")
        swallowed = []

        async def reader():
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(True)  # as wait_for does when the read won the race

        task = source._task = asyncio.get_running_loop().create_task(reader())
        await asyncio.sleep(0)
        closing = asyncio.get_running_loop().create_task(source.aclose())
        done, _ = await asyncio.wait({closing}, timeout=5)
        ended = task.done()
        task.cancel()
        closing.cancel()
        return swallowed, bool(done), ended

    assert asyncio.run(main()) == ([True], True, True)


async def _silent_after(num_events: int, interval_s: float):
    """A loopback stream server: each connection gets the head, then ``num_events`` events
    (a full document, then empty deltas) ``interval_s`` apart, then silence, held open."""
    doc = compact_state(StateReplica(lambda *a: 0.01, num_total_blocks=100).state())
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for seq in range(num_events):
            event = {"seq": 0, "full": doc} if seq == 0 else {"seq": seq, "delta": {}}
            writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await asyncio.sleep(interval_s)
        with contextlib.suppress(Exception):
            await reader.read()  # silent until the client goes

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def test_a_stream_that_goes_silent_resyncs_after_stale_after_s():
    """No byte for ``stale_after_s``: the connection is dropped and a new stream opened; a
    stream whose events keep coming, each well within the bound, is kept though it lasts
    longer than the bound."""
    async def main():
        server, port, connections = await _silent_after(num_events=8, interval_s=0.05)
        source = StreamStateSource(f"http://127.0.0.1:{port}", stale_after_s=0.2)
        try:
            assert await source.opened(5.0) is None
            start_s = time.monotonic()
            while source.num_resyncs == 0 and time.monotonic() - start_s < 10:
                await asyncio.sleep(0.01)
            silent_for_s = time.monotonic() - start_s
            first_events = source.num_events
            await asyncio.sleep(0.1)
            return source.num_resyncs, len(connections), first_events, silent_for_s
        finally:
            await source.aclose()
            server.close()

    num_resyncs, num_connections, first_events, waited_s = asyncio.run(
        asyncio.wait_for(main(), 30))
    assert num_resyncs >= 1 and num_connections >= 2
    assert first_events >= 8  # the first stream's 8 events (0.35 s) all came, on one stream
    assert waited_s >= 0.2  # not before the bound


def test_reading_a_stream_makes_no_task_per_read():
    """The staleness bound is one timer per stream, not ``asyncio.wait_for`` around each read
    (a task per read in Python 3.11)."""
    async def main():
        server, port, _ = await _silent_after(num_events=30, interval_s=0.01)
        loop = asyncio.get_running_loop()
        made = []

        def factory(loop, coro, **kwargs):  # noqa: ANN001, ANN202 - asyncio's signature
            made.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        source = StreamStateSource(f"http://127.0.0.1:{port}", stale_after_s=5.0)
        try:
            assert await source.opened(5.0) is None
            while source.num_events < 5:
                await asyncio.sleep(0.01)
            loop.set_task_factory(factory)
            before = source.num_events
            while source.num_events < 28:
                await asyncio.sleep(0.01)
            loop.set_task_factory(None)
            return source.num_events - before, made
        finally:
            loop.set_task_factory(None)
            await source.aclose()
            server.close()

    num_events, made = asyncio.run(asyncio.wait_for(main(), 30))
    assert num_events >= 20
    assert [name for name in made if "read" in name] == []


def test_a_round_reads_live_streams_in_line_and_the_others_as_before():
    """The poller's round reads a stream that is live (its full document in, its events
    handed over as they came) in line, with no task per replica; a stream that is not live
    yet (nothing listens on its port) is fetched as before, and its failures counted."""
    from guard.proxy.health import GatedSource, ReplicaHealth
    from guard.replicas.auto_source import AutoStateSource
    from guard.replicas.poller import StatePoller

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(2)
        sources = {f"r{i}": StreamStateSource(url, interval_ms=20)
                   for i, url in enumerate(fleet.urls.values())}
        client = httpx.AsyncClient(trust_env=False)
        auto = AutoStateSource(fleet.urls["replica-1"], client=client, stream_interval_ms=20)
        health = ReplicaHealth(["auto"], 3, 1.0, lambda rid: None, None, time.monotonic)
        sources["auto"] = GatedSource("auto", auto, health)
        sources["dead"] = StreamStateSource("http://127.0.0.1:9", timeout_s=0.2)
        load = LoadState()
        poller = StatePoller(load, sources, interval_s=60.0, timeout_s=0.5)
        loop = asyncio.get_running_loop()
        made = []

        def factory(loop, coro, **kwargs):  # noqa: ANN001, ANN202 - asyncio's signature
            made.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        try:
            for _ in range(100):  # until the three streams are live
                await poller.refresh_now()
                if all(sources[r].answers_now for r in ("r0", "r1", "auto")):
                    break
                await asyncio.sleep(0.02)
            assert auto.choice == "stream" and not sources["dead"].answers_now
            loop.set_task_factory(factory)
            await poller.refresh_now()
            loop.set_task_factory(None)
            assert all(load.replica_snapshot(r).capacity_known for r in ("r0", "r1", "auto"))
            assert [poller.consecutive_errors(r) for r in ("r0", "r1", "auto")] == [0, 0, 0]
            assert poller.consecutive_errors("dead") >= 1 and "dead" in poller.unreadable
            return made
        finally:
            loop.set_task_factory(None)
            await poller.stop()
            await client.aclose()
            await fleet.stop()

    made = asyncio.run(asyncio.wait_for(main(), 30))
    # the one replica not live was fetched as before: one task for it (gather's) and one for
    # its bounded fetch (wait_for's, Python 3.11), none for the three live streams
    assert [name for name in made if "_refresh_one" in name] == ["StatePoller._refresh_one"]


class _ScriptedStream(asyncio.Protocol):
    """A loopback stream server with no future or task of its own (timer callbacks write):
    at the request, connection ``i`` writes ``scripts[i]`` (the last script for any later
    one) item by item, ``gap_s`` apart; ``None`` closes the connection, the script's end
    holds it open."""

    def __init__(self, scripts: list[list], connections: list, gap_s: float) -> None:
        self._scripts, self._connections, self._gap_s = scripts, connections, gap_s
        self._items: list = []

    def connection_made(self, transport):  # noqa: ANN001, ANN201
        self._transport = transport
        self._items = list(self._scripts[min(len(self._connections), len(self._scripts) - 1)])
        self._connections.append(transport)

    def data_received(self, data):  # noqa: ANN001, ANN201
        if b"\r\n\r\n" in data:
            self._next()

    def _next(self) -> None:
        if self._items and not self._transport.is_closing():
            item = self._items.pop(0)
            if item is None:
                self._transport.close()
                return
            self._transport.write(item)
            asyncio.get_running_loop().call_later(self._gap_s, self._next)


async def _scripted(scripts: list[list], gap_s: float = 0.002):
    connections: list = []
    server = await asyncio.get_running_loop().create_server(
        lambda: _ScriptedStream(scripts, connections, gap_s), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_HEAD_UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


def _sse(seq: int) -> bytes:
    doc = compact_state(StateReplica(lambda *a: 0.01, num_total_blocks=100).state())
    event = {"seq": 0, "full": doc} if seq == 0 else {"seq": seq, "delta": {}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _closing(source: StreamStateSource, server, connections):  # noqa: ANN001, ANN202
    async def close():
        await source.aclose()
        server.close()
        for transport in connections:
            transport.abort()
    return close()


def test_reading_a_stream_makes_no_future_or_task_per_event():
    """Each event is parsed and fed in line as its bytes arrive (an asyncio.Protocol): while
    100 events arrive, one by one, the reader makes no future (a StreamReader makes one per
    read it waits on) and no task."""
    async def main():
        events = [_chunk(_sse(seq)) for seq in range(150)]
        server, port, connections = await _scripted([[_HEAD, *events]])
        source = StreamStateSource(f"http://127.0.0.1:{port}", stale_after_s=30.0)
        loop = asyncio.get_running_loop()
        hundred = loop.create_future()
        num_heard = []

        def listener(payload):  # noqa: ANN001, ANN202
            num_heard.append(payload)
            if len(num_heard) == 100 and not hundred.done():
                hundred.set_result(None)

        futures, tasks = [], []
        made_future = loop.create_future

        def counting_future():  # noqa: ANN202
            futures.append(True)
            return made_future()

        def factory(loop, coro, **kwargs):  # noqa: ANN001, ANN202 - asyncio's signature
            tasks.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        try:
            assert await source.opened(5.0) is None
            source.listen(listener)
            loop.create_future = counting_future  # this loop's, for the next 100 events
            loop.set_task_factory(factory)
            await hundred  # nothing else on this loop waits meanwhile
            return len(futures), tasks, source.num_events, source.num_resyncs
        finally:
            loop.__dict__.pop("create_future", None)
            loop.set_task_factory(None)
            await _closing(source, server, connections)

    num_futures, tasks, num_events, num_resyncs = asyncio.run(asyncio.wait_for(main(), 30))
    assert num_events >= 101 and num_resyncs == 0
    assert (num_futures, tasks) == (0, [])


@pytest.mark.parametrize("end", [b"zz\r\n", b"0\r\n\r\n", b'c\r\ndata: {"seq"\r\n', None])
def test_a_stream_that_ends_mid_way_is_followed_by_a_new_one(end):
    """A bad chunk size, the last chunk, half an event then EOF (chunked or not): the stream
    ends, with nothing of the half event fed, and a new stream delivers the document."""
    async def main():
        if end is None:  # a body until close, cut mid-event
            first = [_HEAD_UNTIL_CLOSE, _sse(0), _sse(1), _sse(2)[:20], None]
            again = [_HEAD_UNTIL_CLOSE, _sse(0), _sse(1)]
        else:
            first = [_HEAD, _chunk(_sse(0)), _chunk(_sse(1)), end, None]
            again = [_HEAD, _chunk(_sse(0)), _chunk(_sse(1))]
        server, port, connections = await _scripted([first, again])
        source = StreamStateSource(f"http://127.0.0.1:{port}", stale_after_s=30.0)
        try:
            assert await source.opened(5.0) is None
            while source.num_events < 4:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            return (source.num_events, source.num_resyncs, source.num_gaps,
                    len(connections), source.document() is not None, source.answers_now)
        finally:
            await _closing(source, server, connections)

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (4, 1, 0, 2, True, True)


def test_a_round_skips_live_streams_that_push_and_still_fetches_an_ejected_one():
    """Events reach the guard as they arrive, so the round has nothing to read from a live
    stream that pushes them: it fetches none. An ejected replica's stream is fetched as
    before, and the ejection recorded."""
    from guard.proxy.health import GatedSource, ReplicaHealth
    from guard.replicas.poller import StatePoller

    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(3)
        health = ReplicaHealth(["r0", "r1", "r2"], 1, 60.0, lambda rid: None, None,
                               time.monotonic)
        streams = {f"r{i}": StreamStateSource(url, interval_ms=20)
                   for i, url in enumerate(fleet.urls.values())}
        fetched = []
        for rid, stream in streams.items():
            real_fetch = stream.fetch

            async def counted(rid=rid, real_fetch=real_fetch):
                fetched.append(rid)
                return await real_fetch()
            stream.fetch = counted
        sources = {rid: GatedSource(rid, stream, health) for rid, stream in streams.items()}
        load = LoadState()
        poller = StatePoller(load, sources, interval_s=60.0, timeout_s=0.5)
        try:
            for _ in range(100):  # until the three streams are live
                await poller.refresh_now()
                if all(s.answers_now for s in streams.values()):
                    break
                await asyncio.sleep(0.02)
            assert all(s.answers_now for s in streams.values())
            events = {rid: s.num_events for rid, s in streams.items()}
            fetched.clear()
            await poller.refresh_now()
            assert fetched == []  # every one live and pushing: nothing to fetch
            health.record_failure("r2")  # ejected after one failure
            await poller.refresh_now()
            assert fetched == []  # an ejected replica's fetch raises before the stream's
            assert "r2" in poller.unreadable and poller.consecutive_errors("r2") == 1
            assert [poller.consecutive_errors(r) for r in ("r0", "r1")] == [0, 0]
            await asyncio.sleep(0.1)  # the live ones' events still reach the guard
            assert all(streams[r].num_events > events[r] for r in ("r0", "r1"))
            assert all(load.replica_snapshot(r).capacity_known for r in ("r0", "r1"))
        finally:
            await poller.stop()
            await fleet.stop()

    asyncio.run(main())
