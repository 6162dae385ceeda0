"""The compact ``/kvguard/state`` (sequences as columns) gives the guard exactly the snapshot
and the decisions the full document gives; the poller asks only for unseen iteration samples
and asks for all of them again after a replica restarts."""

from __future__ import annotations

import asyncio

from chaos.bench.scale import fleet_document
from engine.compact_state import compact_state, expand_compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.poller import HttpStateSource
from policies.slo import SloPolicy
from tests.policies.policy_builders import make_cost


def _documents(num_replicas: int = 20) -> list[dict]:
    docs = [fleet_document(k, 24 + k) for k in range(num_replicas)]
    # one of the guard's own requests is running on r1: its class and expected length apply
    docs[1]["running"][0]["request_id"] = "mine"
    return docs


def _fed(docs: list[dict], compact: bool) -> LoadState:
    load_state = LoadState()
    load_state.reserve("r1", "mine", make_cost("mine", prompt=200, max_tokens=64), 0.0)
    load_state.reserve("r2", "pending", make_cost("pending", prompt=100, max_tokens=16), 0.0)
    for k, doc in enumerate(docs):
        load_state.update_from_kvguard_state(f"r{k}", compact_state(doc) if compact else doc,
                                             0.0)
    return load_state


def test_compact_state_expands_to_the_full_documents_sequences():
    doc = fleet_document(3, 5)
    expanded = expand_compact_state(compact_state(doc))
    assert expanded["running"] == [{k: s[k] for k in ("request_id", "num_output_tokens",
                                                      "max_tokens", "num_context_tokens",
                                                      "num_prefill_tokens_remaining")}
                                   for s in doc["running"]]
    assert expanded["num_free_blocks"] == doc["num_free_blocks"]
    assert "running" not in compact_state(doc)


def test_the_compact_document_gives_the_same_snapshot_and_decisions():
    docs = _documents()
    full, compact = _fed(docs, False), _fed(docs, True)
    a, b = full.snapshot(0.5), compact.snapshot(0.5)
    assert a.replicas == b.replicas
    assert a.step_time == b.step_time
    assert [r.load for r in a.replicas] == [r.load for r in b.replicas]
    assert full.reservation("mine").reported and compact.reservation("mine").reported
    assert not compact.reservation("pending").reported
    for i in range(40):
        cost = make_cost(f"q{i}", prompt=50 + 40 * i, max_tokens=64, arrival_s=0.5)
        decision = SloPolicy().decide(cost, full.snapshot(0.5))
        assert decision == SloPolicy().decide(cost, compact.snapshot(0.5))
        for load_state in (full, compact):
            if hasattr(decision, "replica_id"):
                load_state.reserve(decision.replica_id, cost.request_id, cost, 0.5)


def test_since_batch_keeps_only_unseen_iterations():
    doc = fleet_document(0, 3)
    assert [it["batch_id"] for it in compact_state(doc, since_batch=1)["iterations"]] == [2, 3]
    assert compact_state(doc)["iterations"] == doc["iterations"]


class _Recorder:
    """A StateClient answering from a list of documents, recording the URLs asked."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs, self.urls = docs, []

    async def get(self, url: str, timeout: float):
        import json

        self.urls.append(url)
        body = json.dumps(self.docs.pop(0)).encode()

        class Response:
            status_code, content = 200, body

            def raise_for_status(self) -> None:
                pass

        return Response()


def test_the_source_asks_for_unseen_samples_and_again_for_all_after_a_restart():
    first = fleet_document(0, 2)  # batches 0-3, step_count 10
    later = compact_state(first, since_batch=3)  # nothing new yet
    later["step_count"] = 12
    restarted = compact_state(first, since_batch=3)  # a new process: its ids are all <= 3
    restarted["step_count"] = 1
    client = _Recorder([first, later, restarted, first])
    source = HttpStateSource("http://r0", client=client)

    async def poll(n: int) -> None:
        for _ in range(n):
            await source.fetch()

    asyncio.run(poll(4))
    base = "http://r0/kvguard/state?compact=1"
    assert client.urls == [base, base + "&since_batch=3", base + "&since_batch=3", base]
