"""The guard warns (once per replica) when a full prefill step is over the tightest class ITL."""

import asyncio
import logging

from policies.cost import RequestClass
from tests.support.admission import PROMPT, Client, http_scope, make_guard


async def _one_request(guard):  # the first request starts the guard: limits read
    client = Client(PROMPT)
    await guard(http_scope(), client.receive, client.send)


class _App:
    async def __call__(self, scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def test_a_chunk_budget_that_stretches_gaps_is_warned_about_once(caplog):
    # 512-token chunks on the default 7 B prior take ~55 ms: over a 20 ms ITL, under 80 ms
    tight = (RequestClass("interactive", ttft_s=1.0, itl_s=0.02),)
    for classes, warned in ((tight, True), (None, False)):
        caplog.clear()
        guard = make_guard(_App(), **({"classes": classes} if classes else {}))

        async def main(guard=guard):
            await _one_request(guard)
            guard.controller._update_limits()  # as on every state refresh
            guard.controller._update_limits()
            await guard.aclose()

        with caplog.at_level(logging.WARNING, logger="guard.controller"):
            asyncio.run(main())
        lines = [r.getMessage() for r in caplog.records if "max-num-batched-tokens" in r.message]
        assert len(lines) == (1 if warned else 0)
        if warned:
            assert lines[0].startswith("replica local: a step with a full 512-token prefill chunk")


def test_no_warning_from_limits_assumed_for_a_vllm_replica(caplog):
    """A vLLM replica's chunk budget and step times are assumed (its /metrics carries neither):
    no warning is computed from them."""
    from guard.admission.replica_limits import ReplicaLimits
    from guard.replicas.load_state import LoadState

    metrics = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
               "vllm:kv_cache_usage_perc 0.0\n"
               'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n')
    load_state = LoadState(2.0)
    load_state.update_from_vllm_metrics("v0", metrics, 0.0, max_num_batched_tokens=65536)
    limits = ReplicaLimits(load_state, itl_s=0.001)
    with caplog.at_level(logging.WARNING, logger="guard.controller"):
        rules = limits.update()
    assert not [r for r in caplog.records if "max-num-batched-tokens" in r.getMessage()]
    assert rules.max_model_len is None  # an unpublished context length is no limit
