"""A column-backed group's finish schedule (``SeqTotals.ends``, what the fleet ranking's
forecast reads for every changed replica) comes from its rows, without a ``SeqLoad`` per
sequence, and equals the schedule of those records: for compact documents and streamed
deltas, with the guard's own requests among the sequences (their expected lengths apply),
sequences still in prefill, a ``max_tokens`` the replica did not give, and after the records
were made."""

from __future__ import annotations

import json

import pytest

from chaos.bench.scale import fleet_document
from engine.compact_state import compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.state_stream import StreamStateSource
from policies.candidates import MIN_RANKED_REPLICAS
from policies.replica_load import SeqTotals
from serving.state_delta import StateDeltas
from tests.policies.policy_builders import make_cost


def _records_ends(totals: SeqTotals) -> list[tuple[int, int]]:
    """The schedule as ``SeqTotals.ends`` computed it from the records (the reference)."""
    bs, chunk = totals.block_size, max(1, totals.chunk_tokens)
    return sorted(((s.num_prefill_tokens_remaining + chunk - 1) // chunk
                   + s.num_remaining_output_tokens,
                   (s.num_context_tokens + s.num_prefill_tokens_remaining
                    + s.num_remaining_output_tokens + bs - 1) // bs)
                  for s in totals.seqs)


def _document(index: int, irregular: bool = True) -> dict:
    doc = fleet_document(index, 40)
    running = doc["running"]
    running[3]["request_id"], running[7]["request_id"] = "ours-a", "ours-b"  # the guard's
    running[5].update(num_prefill_tokens_remaining=700, num_output_tokens=0)  # in prefill
    if irregular:  # (a streamed group with such rows is summed from its columns)
        running[9]["max_tokens"] = None  # not given: one token assumed
        running[11].update(num_output_tokens=300)  # past its max_tokens
    doc["waiting"].append({**running[0], "request_id": "ours-c", "num_output_tokens": 0,
                           "num_context_tokens": 0, "num_prefill_tokens_remaining": 900})
    return doc


def _load_state(ours: bool) -> LoadState:
    load = LoadState()
    if not ours:
        return load
    for rid, prompt, max_tokens in (("ours-a", 200, 900), ("ours-b", 250, 40),
                                    ("ours-c", 900, 64)):
        load.reserve("r0", rid, make_cost(rid, prompt=prompt, max_tokens=max_tokens), 0.0)
    return load


def _groups(snapshot) -> list[SeqTotals]:  # noqa: ANN001 - a ReplicaSnapshot
    load = snapshot.load
    return [load.running, load.waiting]


def _check(snapshot, ours: bool) -> None:  # noqa: ANN001 - a ReplicaSnapshot
    for group in _groups(snapshot):
        fresh = SeqTotals(group.seqs, group.block_size, group.chunk_tokens,
                          group.num_context_tokens, group.num_prefill_tokens,
                          group.num_committed_blocks, group.min_itl_s)
        from_rows = fresh.ends  # no record made yet
        reference = _records_ends(fresh)  # makes the records
        assert from_rows == reference and len(reference) == len(group.seqs) > 0
        again = SeqTotals(group.seqs, group.block_size, group.chunk_tokens,
                          group.num_context_tokens, group.num_prefill_tokens,
                          group.num_committed_blocks, group.min_itl_s)
        assert again.ends == reference  # from the records, now made
    # the guard's requests were priced as its own, or none is
    assert any(s.itl_s is not None for s in snapshot.load.running.seqs) == ours


@pytest.mark.parametrize("ours", [True, False])
def test_a_compact_documents_schedule_from_its_columns_equals_the_records(ours):
    load = _load_state(ours)
    snapshot = load.update_from_kvguard_state("r0", compact_state(_document(0)), 0.0)
    _check(snapshot, ours)


@pytest.mark.parametrize("ours", [True, False])
def test_a_streamed_groups_schedule_from_its_rows_equals_the_records(ours):
    load = _load_state(ours)
    doc, encoder = _document(0, irregular=False), StateDeltas()
    source = StreamStateSource("http://r0")
    for step in range(4):
        if step:
            for seq in doc["running"]:
                if not seq["num_prefill_tokens_remaining"]:
                    seq["num_output_tokens"] += 3
                    seq["num_context_tokens"] += 3
        source.feed(json.loads(json.dumps(encoder.event(compact_state(doc)))))
        snapshot = load.update_from_kvguard_state("r0", source.take(), 0.1 * step)
        # the groups as the stream keeps them (rows and advances), not as columns
        assert {type(g.seqs).__name__ for g in _groups(snapshot)} == {"CapturedSeqs"}
        _check(snapshot, ours)


def test_ranking_the_fleet_makes_no_record_per_sequence(monkeypatch):
    """The ranking forecasts every replica changed since the last view (at 10 Hz, every
    streamed replica), and on a full replica the forecast waits for sequences to finish: it
    reads the finish schedule from the rows."""
    import guard.replicas.documents as documents

    load = LoadState()
    for k in range(MIN_RANKED_REPLICAS + 4):
        doc = fleet_document(k, 64)
        doc["num_free_blocks"] = 2  # full: a request waits for blocks to be freed
        load.update_from_kvguard_state(f"r{k}", compact_state(doc), 0.0)
    made = []
    real = documents.seq_fields
    monkeypatch.setattr(documents, "seq_fields", lambda *a: made.append(a) or real(*a))
    fleet = load.snapshot(0.0).fleet
    assert fleet is not None and len(fleet.ranked) == MIN_RANKED_REPLICAS + 4
    assert made == []


def _full_fleet(num_replicas: int) -> LoadState:
    load = LoadState()
    for k in range(num_replicas):
        doc = fleet_document(k, 64)
        doc["num_free_blocks"] = 2  # full: a forecast waits for sequences to finish
        load.update_from_kvguard_state(f"r{k}", compact_state(doc), 0.0)
    return load


def test_a_state_rounds_limits_read_the_fleet_without_ranking_it(monkeypatch):
    """After every state round the guard re-reads the replicas' limits
    (``ReplicaLimits.update``); ranking every replica changed since the last view is the next
    decision's work, at its own time. The rules are what the snapshot's replicas and step-time
    model give, as before."""
    from guard.admission.replica_limits import ReplicaLimits
    from guard.replicas import fleet_ranking

    load = _full_fleet(MIN_RANKED_REPLICAS + 4)
    ranked = []
    real = fleet_ranking.rank_key
    monkeypatch.setattr(fleet_ranking, "rank_key", lambda *a: ranked.append(a) or real(*a))
    rules = ReplicaLimits(load, itl_s=0.05).update()
    assert ranked == []
    replicas, step_time = load.views()
    snapshot = load.snapshot(0.0)
    assert len(ranked) >= MIN_RANKED_REPLICAS + 4  # the decision's snapshot ranks them
    assert (replicas, step_time) == (snapshot.replicas, snapshot.step_time)
    assert (rules.max_model_len, rules.block_size) == (4096, 16)
