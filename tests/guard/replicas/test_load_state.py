"""guard.replicas.load_state: snapshots from /kvguard/state and vLLM metrics, reservations, the poller."""

import asyncio
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from guard.config import ReplicaConfig
from guard.replicas.load_state import UNKNOWN_MAX_MODEL_LEN, LoadState, parse_vllm_metrics
from guard.replicas.poller import AsgiStateSource, HttpStateSource, StatePoller, state_sources
from policies.cost import RequestClass, RequestCost
from policies.retry_budget import RetryBudgetView
from policies.snapshot import QueuedAhead, SeqLoad
from policies.step_time import StepTimeModel
from policies.step_time_fitter import StepTimeFitter
from tests.support.loopback import LoopbackServer

PRIOR = StepTimeModel(0.01, 1e-4, 1e-4, 1e-7)
INTERACTIVE = RequestClass("interactive", 1.0, 0.08, 0)


def seq(request_id, prompt=100, output=7, max_tokens=64, prefill_left=0):
    return {"request_id": request_id, "num_prompt_tokens": prompt, "num_output_tokens": output,
            "max_tokens": max_tokens, "num_context_tokens": prompt - prefill_left + output,
            "num_prefill_tokens_remaining": prefill_left, "num_blocks": 7}


def state(running=(), waiting=(), iterations=(), step_count=100, free=6000, timing_model=None):
    return {
        "model": "llama-7b", "backend": "sim", "max_model_len": 4096, "block_size": 16,
        "num_total_blocks": 7000, "num_free_blocks": free, "max_num_seqs": 256,
        "max_num_batched_tokens": 2048, "num_preemptions": 0, "step_count": step_count,
        "now_s": 1234.5, "running": list(running), "waiting": list(waiting),
        "iterations": list(iterations), "timing_model": timing_model, "time_scale": 1.0,
    }


def iteration(batch_id, decode=3, context=300, duration_s=0.012):
    return {"batch_id": batch_id, "num_prefill_tokens": 0, "num_decode_seqs": decode,
            "num_context_tokens": context, "duration_s": duration_s, "end_s": 1.0}


def cost(request_id, prompt=100, max_tokens=60, expected=20, blocks=10):
    return RequestCost(request_id, "t", INTERACTIVE, prompt, max_tokens, expected, blocks,
                       arrival_s=0.0, deadline_s=1.0)


def make_state(**kw):
    return LoadState(max_staleness_s=2.0, fitter_factory=lambda prior: StepTimeFitter(prior),
                     default_prior=PRIOR, **kw)


def test_snapshot_from_kvguard_state():
    ls = make_state()
    ls.update_from_kvguard_state(
        "r0", state(running=[seq("a", output=7, max_tokens=64)],
                    waiting=[seq("b", prompt=50, output=0, max_tokens=10, prefill_left=50)]),
        now_s=10.0)
    over = RetryBudgetView(frozenset({"t"}))
    snap = ls.snapshot(10.5, num_queued=3, drain_rate_rps=4.0, retry_budget=over,
                       queued_ahead=QueuedAhead(2, 100, 8))
    (r,) = snap.replicas
    assert (r.replica_id, r.observed_s, r.block_size, r.num_total_blocks, r.num_free_blocks) == (
        "r0", 10.0, 16, 7000, 6000)
    assert (r.max_num_seqs, r.max_num_batched_tokens, r.max_model_len) == (256, 2048, 4096)
    assert r.running == (SeqLoad(107, 0, 57),)
    assert r.waiting == (SeqLoad(0, 50, 10),)
    assert r.reserved == () and r.num_reserved_blocks == 0 and r.healthy
    assert snap.num_queued == 3 and snap.drain_rate_rps == 4.0 and snap.retry_budget is over
    assert snap.queued_ahead == QueuedAhead(2, 100, 8)
    assert snap.step_time == PRIOR and snap.max_staleness_s == 2.0


def test_a_state_update_leaves_the_next_decision_no_summing_to_do(monkeypatch):
    """The engine groups' sums and the mean step-time model are built when the state arrives
    (the poll), not by the first decision after it: at low load a refresh lands between most
    requests, so that work sat on every request's way to the upstream."""
    import policies.replica_load as replica_load
    import policies.snapshot as snapshot_module

    ls = make_state()
    ls.update_from_kvguard_state(
        "r0", state(running=[seq("a")], waiting=[seq("b", prefill_left=30)]), now_s=10.0)
    ls.update_from_kvguard_state("r1", state(running=[seq("c")]), now_s=10.0)
    summed = []
    real_of = replica_load.ReplicaLoad.of
    monkeypatch.setattr(replica_load.ReplicaLoad, "of",
                        classmethod(lambda cls, *a: summed.append(a) or real_of(*a)))
    monkeypatch.setattr(snapshot_module.SeqTotals, "of",
                        staticmethod(lambda *a: summed.append(a)))
    monkeypatch.setattr(ls, "_mean_model", lambda replicas: summed.append(replicas))
    snap = ls.snapshot(10.5)
    loads = [r.load for r in snap.replicas]
    assert summed == []
    assert [x.num_seqs for x in loads] == [2, 1] and snap.step_time == PRIOR


def test_staleness_and_unhealthy():
    ls = make_state()
    ls.update_from_kvguard_state("r0", state(), now_s=10.0)
    ls.update_from_kvguard_state("r1", state(), now_s=11.5)
    assert [r.replica_id for r in ls.snapshot(12.0).fresh_replicas()] == ["r0", "r1"]
    assert [r.replica_id for r in ls.snapshot(12.5).fresh_replicas()] == ["r1"]
    ls.mark_unhealthy("r1", 12.5)
    assert not ls.is_healthy("r1")
    assert ls.snapshot(12.5).fresh_replicas() == ()
    ls.update_from_kvguard_state("r1", state(), now_s=13.0)  # a good state heals it
    assert [r.replica_id for r in ls.snapshot(13.0).fresh_replicas()] == ["r1"]


def test_a_replicas_served_model_is_the_one_its_last_state_named():
    """What the model catalog compares with a replica's ``/v1/models`` list."""
    ls = make_state()
    assert ls.served_model("r0") is None  # no state yet
    ls.update_from_kvguard_state("r0", state(), now_s=1.0)
    assert ls.served_model("r0") == "llama-7b"
    ls.update_from_kvguard_state("r0", {**state(), "model": "llama-13b"}, now_s=2.0)
    assert ls.served_model("r0") == "llama-13b"
    ls.update_from_kvguard_state("r0", {**state(), "model": 7}, now_s=3.0)
    assert ls.served_model("r0") is None  # not a name


def test_configured_weights_reach_every_snapshot_of_the_replica():
    ls = make_state(weights={"r0": 3.0})
    ls.update_from_kvguard_state("r0", state(), now_s=1.0)
    ls.mark_unknown_capacity("r1", now_s=1.0)
    assert [r.weight for r in ls.snapshot(1.0).replicas] == [3.0, 1.0]
    ls.reserve("r0", "a", cost("a"), now_s=1.0)  # with reservations
    assert ls.replica_snapshot("r0").weight == 3.0 and ls.replica_snapshot("r0").reserved
    ls.mark_unhealthy("r0", 1.5)
    assert ls.replica_snapshot("r0").weight == 3.0
    ls.update_from_vllm_metrics("r0", VLLM_METRICS, now_s=2.0)
    assert ls.replica_snapshot("r0").weight == 3.0
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"weights\['r0'\]"):
            make_state(weights={"r0": bad})


def test_reservation_dropped_when_state_lists_the_request():
    ls = make_state()
    ls.update_from_kvguard_state("r0", state(), now_s=1.0)
    ls.reserve("r0", "g1", cost("g1", blocks=10), now_s=1.1)
    ls.reserve("r0", "g2", cost("g2", blocks=5), now_s=1.1)
    assert ls.num_reserved_blocks("r0") == 15
    r = ls.replica_snapshot("r0")
    assert r.num_reserved_blocks == 15 and r.num_inflight == 2
    assert r.reserved[0] == SeqLoad(0, 100, 20, itl_s=0.08, admitted_s=1.1)  # paced from then
    assert r.num_available_blocks == 6000 - 15
    # the replica now reports g1: its blocks are in num_free_blocks, the reservation is dropped
    ls.update_from_kvguard_state("r0", state(running=[seq("g1", output=5, max_tokens=60)],
                                             free=5990), now_s=1.2)
    r = ls.replica_snapshot("r0")
    assert r.num_reserved_blocks == 5 and r.num_inflight == 2
    # a request we admitted: remaining output from its expected length (20 - 5), with its ITL
    assert r.running == (SeqLoad(105, 0, 15, itl_s=0.08),)
    assert ls.release("g2") and not ls.release("g2")
    assert ls.num_reserved_blocks("r0") == 0 and ls.replica_snapshot("r0").num_inflight == 1
    assert ls.release("g1")
    assert ls.replica_snapshot("r0").num_inflight == 0


def test_one_reservation_record_moves_between_replicas_and_is_released_once():
    ls = make_state()
    for replica_id in ("r0", "r1"):
        ls.update_from_kvguard_state(replica_id, state(), now_s=1.0)
    record = ls.reserve("r0", "g1", cost("g1", blocks=10), now_s=1.1)
    assert ls.reservation("g1") is record and record.replica_id == "r0"
    # r0 reports it (pending no more), then fails: the same record moves, pending on r1 again
    ls.update_from_kvguard_state("r0", state(running=[seq("g1", output=5, max_tokens=60)]), 1.2)
    assert ls.num_reserved_blocks("r0") == 0 and ls.num_inflight("r0") == 1
    assert ls.move("g1", "r1", now_s=1.3)
    assert ls.reservation("g1") is record and record.replica_id == "r1"
    assert (ls.num_inflight("r0"), ls.num_inflight("r1")) == (0, 1)
    assert ls.num_reserved_blocks("r1") == 10
    assert ls.replica_snapshot("r1").reserved[0].admitted_s == 1.3  # paced from the move
    assert ls.release("g1") and not ls.release("g1") and not ls.move("g1", "r0", 1.4)
    assert ls.reservation("g1") is None
    assert (ls.num_inflight("r0"), ls.num_inflight("r1")) == (0, 0)
    assert ls.num_reserved_blocks("r1") == 0


def test_iterations_fed_once_by_batch_id_and_restart_detected():
    ls = make_state()
    its = [iteration(i) for i in range(1, 6)]
    ls.update_from_kvguard_state("r0", state(iterations=its, step_count=5), now_s=1.0)
    ls.update_from_kvguard_state("r0", state(iterations=its + [iteration(6)], step_count=6), 2.0)
    assert ls.fitter("r0").num_samples == 6
    ls.update_from_kvguard_state("r0", state(iterations=[iteration(1)], step_count=1), 3.0)
    assert ls.fitter("r0").num_samples == 7  # the engine restarted: batch 1 is a new step


def test_a_malformed_iteration_feeds_the_fitter_none_of_its_document():
    ls = make_state()
    ls.update_from_kvguard_state("r0", state(iterations=[iteration(1)], step_count=1), 1.0)
    broken = {k: v for k, v in iteration(3).items() if k != "duration_s"}
    with pytest.raises(KeyError):
        ls.update_from_kvguard_state("r0", state(iterations=[iteration(2), broken],
                                                 step_count=3), 2.0)
    assert ls.fitter("r0").num_samples == 1
    ls.update_from_kvguard_state("r0", state(iterations=[iteration(2), iteration(3)],
                                             step_count=3), 3.0)
    assert ls.fitter("r0").num_samples == 3  # batch 2 was not taken as seen


def test_fitted_model_reaches_the_snapshot_and_timing_model_prior():
    ls = make_state()
    tm = {"base_s": 0.002, "per_prefill_token_s": 1e-5, "per_decode_seq_s": 1e-4,
          "per_context_token_s": 0.0}
    ls.update_from_kvguard_state("sim", state(timing_model=tm), now_s=0.0)
    assert ls.step_time_model("sim") == StepTimeModel(0.002, 1e-5, 1e-4, 0.0)
    true = StepTimeModel(0.003, 1e-5, 2e-4, 1e-7)
    its = [iteration(i, decode=1 + i % 9, context=100 * (i % 13 + 1),
                     duration_s=true.step_s(0, 1 + i % 9, 100 * (i % 13 + 1)))
           for i in range(1, 41)]
    ls.update_from_kvguard_state("sim", state(iterations=its, timing_model=tm), now_s=1.0)
    fitted = ls.snapshot(1.0).step_time
    assert fitted.base_s == pytest.approx(0.003, rel=0.05)
    assert fitted.per_decode_seq_s == pytest.approx(2e-4, rel=0.05)
    assert fitted.per_prefill_token_s == pytest.approx(1e-5)  # not excited: the prior's


def test_snapshot_step_time_is_mean_over_healthy_replicas():
    ls = make_state()
    tm = {"base_s": 0.002, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
          "per_context_token_s": 0.0}
    ls.update_from_kvguard_state("a", state(timing_model=tm), now_s=0.0)
    ls.update_from_kvguard_state("b", state(timing_model={**tm, "base_s": 0.004}), now_s=0.0)
    assert ls.snapshot(0.0).step_time.base_s == pytest.approx(0.003)
    ls.mark_unhealthy("b", 0.0)
    assert ls.snapshot(0.0).step_time.base_s == pytest.approx(0.002)


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_cpu_blocks="None",num_gpu_blocks="1000"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
"""


def test_parse_vllm_metrics():
    m = parse_vllm_metrics(VLLM_METRICS)
    assert m["num_requests_running"] == 3 and m["num_requests_waiting"] == 2
    assert m["kv_cache_usage_ratio"] == 0.25
    assert m["block_size"] == 16 and m["num_gpu_blocks"] == 1000
    old = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_vllm_metrics(old)["kv_cache_usage_ratio"] == 0.25
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        parse_vllm_metrics(VLLM_METRICS.replace("cache_config_info", "other_thing"))


def test_snapshot_from_vllm_metrics_and_reservations_end_after_a_later_scrape():
    ls = make_state()
    r = ls.update_from_vllm_metrics("v", VLLM_METRICS, now_s=1.0, max_model_len=8192)
    assert (r.num_total_blocks, r.num_free_blocks, r.block_size, r.max_model_len) == (
        1000, 750, 16, 8192)
    unknown = make_state().update_from_vllm_metrics("v", VLLM_METRICS, now_s=1.0)
    assert unknown.max_model_len == UNKNOWN_MAX_MODEL_LEN
    assert r.running == (SeqLoad(250 * 16 // 3, 0, 128),) * 3
    assert len(r.waiting) == 2
    ls.reserve("v", "g1", cost("g1", blocks=10), now_s=1.5)
    ls.update_from_vllm_metrics("v", VLLM_METRICS, now_s=2.0)  # may have started before g1
    assert ls.num_reserved_blocks("v") == 10
    ls.update_from_vllm_metrics("v", VLLM_METRICS, now_s=2.1)  # started after g1 was admitted
    assert ls.num_reserved_blocks("v") == 0 and ls.num_inflight("v") == 1


# --- poller -------------------------------------------------------------------------------------


def engine_app(counter):
    async def kvguard_state(request):
        counter["n"] += 1
        return JSONResponse(state(running=[seq("a")], iterations=[iteration(counter["n"])],
                                  step_count=counter["n"]))

    async def metrics(request):
        return PlainTextResponse(VLLM_METRICS)

    return Starlette(routes=[Route("/kvguard/state", kvguard_state), Route("/metrics", metrics)])


async def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_poller_over_loopback_http():
    counter = {"n": 0}

    async def main():
        ls = make_state()
        async with httpx.AsyncClient() as client:
            with LoopbackServer(engine_app(counter)) as server:
                poller = StatePoller(ls, {
                    "r0": HttpStateSource(server.url, "kvguard", client=client),
                    "v0": HttpStateSource(server.url + "/", "vllm", client=client),
                }, interval_s=0.01)
                await poller.refresh_now()
                snap = ls.snapshot(time.monotonic())
                assert {r.replica_id for r in snap.fresh_replicas()} == {"r0", "v0"}
                poller.start()
                await wait_for(lambda: ls.fitter("r0").num_samples >= 3)
                await asyncio.wait_for(poller.stop(), 5.0)
        return ls

    ls = asyncio.run(main())
    assert ls.replica_snapshot("v0").num_total_blocks == 1000
    assert ls.replica_snapshot("r0").running == (SeqLoad(107, 0, 57),)


def test_poller_in_process_asgi_source():
    counter = {"n": 0}

    async def main():
        ls = make_state()
        poller = StatePoller(ls, {"local": AsgiStateSource(engine_app(counter))}, interval_s=0.05)
        await poller.refresh_now()
        await poller.refresh_now()
        return ls

    ls = asyncio.run(main())
    assert counter["n"] == 2 and ls.fitter("local").num_samples == 2
    assert ls.replica_snapshot("local").num_free_blocks == 6000


def test_state_sources_from_config():
    app = engine_app({"n": 0})
    client = object()  # an httpx.AsyncClient stand-in: building sources sends nothing
    local = state_sources((), client, app)
    assert list(local) == ["local"] and isinstance(local["local"], AsgiStateSource)
    replicas = (ReplicaConfig("a", "http://127.0.0.1:1/", "kvguard"),
                ReplicaConfig("b", "http://127.0.0.1:2", "vllm", max_model_len=2048),
                ReplicaConfig("c", None, "asgi"))
    sources = state_sources(replicas, client, app)
    assert sources["a"].url == "http://127.0.0.1:1/kvguard/state"
    assert sources["b"].url == "http://127.0.0.1:2/metrics" and sources["b"].kind == "vllm"
    assert sources["b"].max_model_len == 2048
    assert isinstance(sources["c"], AsgiStateSource)
    with pytest.raises(ValueError):
        state_sources((), client)
    with pytest.raises(ValueError):
        HttpStateSource("http://x", "grpc", client=client)


def test_asgi_source_non_200_is_an_error():
    async def main():
        source = AsgiStateSource(Starlette(routes=[]))
        with pytest.raises(RuntimeError, match="404"):
            await source.fetch()

    asyncio.run(main())


class FlakySource:
    kind = "kvguard"

    def __init__(self):
        self.fail = True
        self.calls = 0

    async def fetch(self):
        self.calls += 1
        if self.fail:
            raise ConnectionError("replica down")
        return state()


def test_failing_source_marks_unhealthy_and_poller_keeps_running():
    async def main():
        ls = make_state()
        ls.update_from_kvguard_state("r0", state(), now_s=time.monotonic())
        source = FlakySource()
        refreshed = []
        poller = StatePoller(ls, {"r0": source}, interval_s=0.005, unhealthy_after_errors=3,
                             on_refresh=lambda: refreshed.append(1))
        await poller.refresh_now()
        await poller.refresh_now()
        assert ls.is_healthy("r0") and poller.consecutive_errors("r0") == 2
        await poller.refresh_now()
        assert not ls.is_healthy("r0")
        poller.start()
        calls = source.calls
        await wait_for(lambda: source.calls >= calls + 3)  # still polling after failures
        source.fail = False
        await wait_for(lambda: ls.is_healthy("r0"))
        await asyncio.wait_for(poller.stop(), 5.0)
        assert poller.consecutive_errors("r0") == 0 and len(refreshed) >= 4

    asyncio.run(main())


class HangingSource:
    kind = "kvguard"

    async def fetch(self):
        await asyncio.Event().wait()


def test_stop_returns_promptly_with_a_hung_fetch():
    async def main():
        ls = make_state()
        poller = StatePoller(ls, {"r0": HangingSource()}, interval_s=0.01, timeout_s=60.0)
        poller.start()
        await asyncio.sleep(0.05)  # the fetch is now in flight
        started = time.monotonic()
        await asyncio.wait_for(poller.stop(), 5.0)
        await poller.stop()  # idempotent
        return time.monotonic() - started

    assert asyncio.run(main()) < 5.0


def test_fetch_timeout_counts_as_failure():
    async def main():
        ls = make_state()
        poller = StatePoller(ls, {"r0": HangingSource()}, interval_s=0.01, timeout_s=0.01)
        await poller.refresh_now()
        return poller.consecutive_errors("r0")

    assert asyncio.run(main()) == 1


# --- drain rate -----------------------------------------------------------------------------------


def test_drain_rate_over_sliding_window():
    from guard.admission.shedding import DrainRate

    rate = DrainRate(window_s=10.0)
    assert rate.rate_rps(0.0) == 0.0
    rate.record(100.0)
    assert rate.rate_rps(100.0) == 1.0  # young estimator: divided by at least one second
    for i in range(1, 40):
        rate.record(100.0 + i * 0.25)  # 4 per second
    assert rate.rate_rps(109.75) == pytest.approx(4.0, rel=0.05)
    assert rate.rate_rps(115.0) == pytest.approx(20 / 10.0, rel=0.1)  # older ones left the window
    assert rate.rate_rps(200.0) == 0.0
    rate.record(200.0, count=5)
    assert rate.rate_rps(200.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        DrainRate(window_s=0)


def test_rising_preemption_counter_is_reported():
    from tests.support.admission import state_doc

    state, seen = LoadState(), []
    state.on_preemptions = lambda replica_id, num: seen.append((replica_id, num))
    for counter in (5, 5, 7, 0, 2):  # the first is a baseline; 0 is a restart
        state.update_from_kvguard_state("r0", {**state_doc(), "num_preemptions": counter}, 1.0)
    assert seen == [("r0", 2), ("r0", 2)]
