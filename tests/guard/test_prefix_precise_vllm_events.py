"""The precise prefix view in front of vLLM: KV-cache event batches encoded as vLLM publishes
them (msgspec maps, 32-byte sha256 block hashes, ``[topic, seq, payload]`` over a ZMQ PUB
socket) reach a guard's controller configured with a ``state_source = "vllm"`` replica; its
model comes from the replica's ``/metrics`` labels (fed as the poller feeds them). The events
are translated into kvguard's block chain, so a request with that prefix is predicted cached
there — and one that diverges is predicted cached up to where it diverges."""

import asyncio
import hashlib

import msgpack
import zmq
from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.controller import AdmissionController
from tests.support.tokenizer_file import word_level_tokenizer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = list(range(3000, 3640))  # 640 tokens: 40 blocks of 16
METRICS = f"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="4096"}} 1.0
"""




def vllm_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Some 32-byte hash chained over the parent, as vLLM's sha256 ones are (the guard never
    recomputes them: it only needs them to name blocks consistently)."""
    return hashlib.sha256(parent + repr(tokens).encode()).digest()


def stored_events(tokens: list[int], parent: bytes | None, num_per_event: int) -> list[dict]:
    events, chain = [], parent
    for start in range(0, len(tokens), 16 * num_per_event):
        part = tokens[start:start + 16 * num_per_event]
        hashes = []
        for b in range(0, len(part), 16):
            chain = vllm_hash(chain or b"root", part[b:b + 16])
            hashes.append(chain)
        events.append({"type": "BlockStored", "block_hashes": hashes,
                       "parent_block_hash": parent, "token_ids": part, "block_size": 16,
                       "lora_id": None, "medium": "GPU", "lora_name": None})
        parent = hashes[-1]
    return events


def test_vllm_events_over_zmq_make_the_guard_predict_the_hit(tmp_path):
    async def scenario():
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        config = GuardConfig.from_dict({
            "prefix_cache": "precise", "tokenizer": word_level_tokenizer(tmp_path),
            "replicas": [{"replica_id": "v0", "url": "http://127.0.0.1:9",
                          "state_source": "vllm",
                          "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}]})
        controller = AdmissionController(config, registry=CollectorRegistry())
        controller.load_state.update_from_vllm_metrics("v0", METRICS, 0.0)
        controller.prefix_cache.start()
        index = controller.prefix_cache.view.index
        try:
            batches = [msgpack.packb({"ts": 1.0, "events": stored_events(PROMPT, None, 10),
                                      "data_parallel_rank": 0})]
            seq = 0
            for _ in range(300):  # a SUB joins late: publish until the blocks arrive (bounded)
                pub.send_multipart([b"", seq.to_bytes(8, "big"), batches[0]])
                seq += 1
                await asyncio.sleep(0.01)
                if index.num_blocks("v0") == 40:
                    break
            assert index.num_blocks("v0") == 40

            def cached(prompt):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
                return controller.pricer.price_request(
                    body, "/v1/completions", {}, config.anonymous_tenant, 0.0,
                    max_model_len=8192, block_size=16).cost.cached_prefix_tokens

            assert cached(PROMPT) == {"v0": 640}
            diverging = PROMPT[:100] + [1] * 60
            assert cached(diverging) == {"v0": 96}  # 6 whole blocks before it diverges
            assert cached(list(range(5000, 5640))) is None
            # another model's request on the same blocks is not a hit (LoRA names differ)
            body = {"model": "sql-adapter", "prompt": PROMPT, "max_tokens": 8}
            assert controller.pricer.price_request(
                body, "/v1/completions", {}, config.anonymous_tenant, 0.0, max_model_len=8192,
                block_size=16).cost.cached_prefix_tokens is None
        finally:
            await controller.prefix_cache.aclose()
            pub.close()
            context.term()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_which_replicas_are_translated_and_from_which_root(tmp_path):
    from guard.replicas.block_hashes import root_hash

    config = GuardConfig.from_dict({
        "prefix_cache": "precise", "tokenizer": word_level_tokenizer(tmp_path),
        "replicas": [
            {"replica_id": "k", "url": "http://127.0.0.1:9", "state_source": "kvguard"},
            {"replica_id": "s", "url": "http://127.0.0.1:9", "state_source": "stream"},
            {"replica_id": "v", "url": "http://127.0.0.1:9", "state_source": "vllm",
             "models": ["served-name", "alias"]},
            {"replica_id": "a", "url": "http://127.0.0.1:9", "state_source": "auto"}]})
    feed = AdmissionController(config, registry=CollectorRegistry()).prefix_cache
    translated = feed.events.translated
    assert [r for r in "ksva" if translated(r)] == ["v", "a"]
    # a configured model name wins over what the metrics say; unknown: nothing to root at
    feed.view.replica_metrics("v", {}, "from-metrics")
    assert feed._root_of("v") == root_hash("served-name")
    assert feed._root_of("a") is None
    # an auto replica that answers with a kvguard state document is a kvguard engine: its
    # events are applied as they are from then on, and what was translated is forgotten
    feed.view.index.insert("a", [1, 2])
    feed.view.replica_state("a", {"model": "m"})
    assert not translated("a") and feed.view.index.num_blocks("a") == 0
