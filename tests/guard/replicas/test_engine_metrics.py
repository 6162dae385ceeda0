"""SGLang, TGI and llama.cpp ``/metrics`` pages into the same snapshot fields; ``auto`` probing.

The pages under ``data/`` were written from each engine's own metric definitions, checked on
2026-12-06 against their sources: SGLang ``python/sglang/srt/metrics/collector.py`` (gauges
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:max_total_num_tokens``) and its ``docs/references/production_metrics.md`` sample page;
TGI's batcher (``tgi_batch_current_size``, ``tgi_batch_current_max_tokens``,
``tgi_queue_size``); llama.cpp server's README and ``server.cpp`` (``llamacpp:requests_processing``,
``llamacpp:requests_deferred``, and ``llamacpp:kv_cache_usage_ratio`` only in builds before the
unified KV cache: ``llamacpp_metrics_older.txt``), and its ``/slots`` (one object per slot with
``is_processing``; older builds ``state``: ``llamacpp_slots.json``).
"""

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from guard.replicas.auto_source import LEARNED, AutoStateSource
from guard.replicas.engine_metrics import (
    detect_metrics_engine,
    parse_engine_metrics,
    parse_llamacpp_slots,
)
from guard.replicas.load_state import LoadState
from guard.replicas.poller import HttpStateSource, StatePoller
from tests.support.loopback import LoopbackServer

DATA = Path(__file__).parent / "data"


def page(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize("engine, name, running, waiting, usage, kv_tokens", [
    ("sglang", "sglang_metrics.txt", 3, 2, 0.28, 163840),
    ("tgi", "tgi_metrics.txt", 12, 5, None, None),
    ("llamacpp", "llamacpp_metrics.txt", 2, 1, None, None),
    ("llamacpp", "llamacpp_metrics_older.txt", 2, 1, 0.63, None),
])
def test_recorded_pages_parse_into_the_same_fields(engine, name, running, waiting, usage,
                                                   kv_tokens):
    load = parse_engine_metrics(engine, page(name))
    assert (load.engine, load.num_requests_running, load.num_requests_waiting) == (
        engine, running, waiting)
    assert load.kv_cache_usage_ratio == usage
    assert load.num_kv_tokens == kv_tokens
    assert detect_metrics_engine(page(name)) == engine


def test_sglang_page_gives_a_known_capacity_snapshot():
    ls = LoadState()
    snap = ls.update_from_engine_metrics("r0", parse_engine_metrics("sglang",
                                                                    page("sglang_metrics.txt")),
                                         now_s=5.0)
    assert snap.capacity_known
    assert (snap.block_size, snap.num_total_blocks) == (16, 163840 // 16)
    assert snap.num_free_blocks == round(10240 * (1 - 0.28))
    assert (len(snap.running), len(snap.waiting)) == (3, 2)
    # the running requests share the used KV evenly, as for a vLLM page
    assert snap.running[0].num_context_tokens == (10240 - snap.num_free_blocks) * 16 // 3


@pytest.mark.parametrize("engine, name", [("tgi", "tgi_metrics.txt"),
                                          ("llamacpp", "llamacpp_metrics.txt")])
def test_counts_without_kv_size_keep_the_capacity_unknown(engine, name):
    ls = LoadState()
    snap = ls.update_from_engine_metrics("r0", parse_engine_metrics(engine, page(name)), 5.0)
    assert not snap.capacity_known and snap.healthy
    load = parse_engine_metrics(engine, page(name))
    assert (len(snap.running), len(snap.waiting)) == (load.num_requests_running,
                                                      load.num_requests_waiting)


def test_a_page_missing_a_required_gauge_names_it():
    with pytest.raises(ValueError, match="sglang:num_running_reqs, sglang:num_queue_reqs"):
        parse_engine_metrics("sglang", page("sglang_metrics_truncated.txt"))
    with pytest.raises(ValueError, match="llamacpp metrics are not Prometheus text"):
        parse_engine_metrics("llamacpp", page("not_metrics.txt"))
    with pytest.raises(ValueError, match="engine: must be one of"):
        parse_engine_metrics("ollama", page("tgi_metrics.txt"))
    assert detect_metrics_engine(page("not_metrics.txt")) is None


def engine_app(metrics_text: str | None, state: dict | None = None) -> Starlette:
    """A replica serving a recorded ``/metrics`` page (404 when None) and, optionally, a
    ``/kvguard/state`` document."""

    async def metrics(request):
        if metrics_text is None:
            return Response(status_code=404)
        return PlainTextResponse(metrics_text)

    async def kvguard_state(request):
        if state is None:
            return Response(status_code=404)
        return JSONResponse(state)

    return Starlette(routes=[Route("/metrics", metrics), Route("/kvguard/state", kvguard_state)])


def poll_once(url: str, source_factory) -> tuple[LoadState, StatePoller, object]:
    async def main():
        async with httpx.AsyncClient(timeout=5) as client:
            source = source_factory(url, client)
            load_state = LoadState()
            poller = StatePoller(load_state, {"r0": source}, interval_s=1.0)
            await poller.refresh_now()
            return load_state, poller, source

    return asyncio.run(main())


def test_an_unparseable_page_is_logged_and_the_replica_is_learned(caplog):
    caplog.set_level(logging.INFO, logger="guard.replicas.poller")
    with LoopbackServer(engine_app(page("sglang_metrics_truncated.txt"))) as server:
        load_state, poller, _ = poll_once(
            server.url, lambda url, client: HttpStateSource(url, "sglang", client=client))
    snap = load_state.replica_snapshot("r0")
    assert snap is not None and snap.healthy and not snap.capacity_known
    assert poller.consecutive_errors("r0") == 0  # never counted towards unhealthy
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "sglang metrics lack sglang:num_running_reqs" in warnings[0].getMessage()


def test_an_unparseable_page_is_logged_once_per_reason(caplog):
    caplog.set_level(logging.INFO, logger="guard.replicas.poller")

    async def main(url: str):
        async with httpx.AsyncClient(timeout=5) as client:
            load_state = LoadState()
            poller = StatePoller(load_state, {"r0": HttpStateSource(url, "tgi", client=client)},
                                 interval_s=1.0)
            for _ in range(3):
                await poller.refresh_now()
            return load_state

    with LoopbackServer(engine_app(page("not_metrics.txt"))) as server:
        load_state = asyncio.run(main(server.url))
    assert load_state.is_healthy("r0")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("name, engine", [("sglang_metrics.txt", "sglang"),
                                          ("tgi_metrics.txt", "tgi"),
                                          ("llamacpp_metrics.txt", "llamacpp")])
def test_auto_finds_each_engine_by_its_metrics(name, engine, caplog):
    caplog.set_level(logging.INFO, logger="guard.replicas.auto_source")
    with LoopbackServer(engine_app(page(name))) as server:
        load_state, _, source = poll_once(
            server.url, lambda url, client: AutoStateSource(url, client=client, replica_id="r0"))
    assert (source.choice, source.kind) == (engine, engine)
    assert "/kvguard/state answered 404" in source.reason
    snap = load_state.replica_snapshot("r0")
    expected = parse_engine_metrics(engine, page(name))
    assert len(snap.running) == expected.num_requests_running
    assert [r.getMessage() for r in caplog.records] == [
        f"replica r0 ({server.url}): state_source auto chose {engine}: {source.reason}"]


def test_auto_prefers_kvguard_state():
    state = {"model": "m", "block_size": 16, "num_total_blocks": 100, "num_free_blocks": 90,
             "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048,
             "running": [], "waiting": []}
    with LoopbackServer(engine_app(page("sglang_metrics.txt"), state)) as server:
        load_state, _, source = poll_once(
            server.url, lambda url, client: AutoStateSource(url, client=client))
    assert source.choice == "kvguard"
    assert load_state.replica_snapshot("r0").num_total_blocks == 100


@pytest.mark.parametrize("metrics, reason", [
    (None, "/metrics answered 404"),
    ("# a page of someone else's gauges\nhttp_requests_total 3\n", "no vLLM, SGLang, TGI"),
    ("vllm:num_requests_running 1\n", "looks like vllm but: vLLM metrics lack"),
])
def test_auto_falls_back_to_learning(metrics, reason):
    with LoopbackServer(engine_app(metrics)) as server:
        load_state, poller, source = poll_once(
            server.url, lambda url, client: AutoStateSource(url, client=client))
    assert source.choice == LEARNED and reason in source.reason
    snap = load_state.replica_snapshot("r0")
    assert snap.healthy and not snap.capacity_known
    assert poller.consecutive_errors("r0") == 0


def test_auto_probes_again_after_reprobe_s_and_finds_late_metrics():
    pages: dict[str, str | None] = {"metrics": None}

    async def metrics(request):
        if pages["metrics"] is None:
            return Response(status_code=404)
        return PlainTextResponse(pages["metrics"])

    app = Starlette(routes=[Route("/metrics", metrics)])
    now = [0.0]

    async def main(url: str):
        async with httpx.AsyncClient(timeout=5) as client:
            source = AutoStateSource(url, client=client, reprobe_s=30.0, clock=lambda: now[0])
            load_state = LoadState()
            poller = StatePoller(load_state, {"r0": source}, interval_s=1.0,
                                 clock=lambda: now[0])
            await poller.refresh_now()
            first = source.choice
            pages["metrics"] = page("tgi_metrics.txt")  # the engine starts exporting
            now[0] = 29.0
            await poller.refresh_now()
            before_reprobe = source.choice
            now[0] = 30.0
            await poller.refresh_now()
            return first, before_reprobe, source.choice, load_state.replica_snapshot("r0")

    with LoopbackServer(app) as server:
        first, before, after, snap = asyncio.run(main(server.url))
    assert (first, before, after) == (LEARNED, LEARNED, "tgi")
    assert len(snap.running) == 12 and not snap.capacity_known


def test_llamacpp_slots_give_the_slot_count_and_the_busy_ones():
    load = parse_llamacpp_slots(page("llamacpp_slots.json"))
    assert (load.num_requests_running, load.num_requests_waiting, load.num_slots) == (2, 0, 4)
    assert parse_llamacpp_slots('[{"id": 0, "state": 1}, {"id": 1, "state": 0}]').num_slots == 2
    for bad in ("<html>", "{}", "[]", '[{"id": 0}]'):
        with pytest.raises(ValueError, match="llama.cpp /slots"):
            parse_llamacpp_slots(bad)
    snap = LoadState().update_from_engine_metrics("r0", load, 1.0)
    assert snap.max_num_seqs == 4 and not snap.capacity_known


def slots_app(metrics_status: int) -> Starlette:
    """llama-server without --metrics: /metrics answers ``metrics_status``, /slots lists 4."""

    async def metrics(request):
        return Response(status_code=metrics_status)

    async def slots(request):
        return PlainTextResponse(page("llamacpp_slots.json"), media_type="application/json")

    return Starlette(routes=[Route("/metrics", metrics), Route("/slots", slots)])


@pytest.mark.parametrize("metrics_status", [404, 501])
def test_llamacpp_source_falls_back_to_slots(metrics_status):
    with LoopbackServer(slots_app(metrics_status)) as server:
        load_state, _, _ = poll_once(
            server.url, lambda url, client: HttpStateSource(url, "llamacpp", client=client))
    snap = load_state.replica_snapshot("r0")
    assert (len(snap.running), snap.max_num_seqs) == (2, 4)


def test_auto_finds_llamacpp_by_its_slots():
    with LoopbackServer(slots_app(501)) as server:
        load_state, _, source = poll_once(
            server.url, lambda url, client: AutoStateSource(url, client=client))
    assert source.choice == "llamacpp" and "/slots lists llama.cpp's slots" in source.reason
    assert load_state.replica_snapshot("r0").max_num_seqs == 4
