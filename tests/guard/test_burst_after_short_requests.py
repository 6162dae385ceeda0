"""The reliability battery's stale-estimate finding, decided in-process on a fake clock: after a
window of short requests (8 output tokens at 200 req/s), a burst of 200 streams of 512-token
prompts on the idle replica must be admitted about as far as a fresh guard admits it.

The estimate that went stale was the step-time model: fitted on short requests, it priced the
terms that window barely excites (context tokens, large decode batches) at many times their
cost, so the burst's forecasts missed the 1 s TTFT and two thirds were shed
``slo_unattainable`` while the admitted ones got their first token far inside it. The engine
is the sim backend, whose steps follow its prior plus the host's own time; the window is one
recorded from it."""

import json
import math
import random
from pathlib import Path

from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.replicas.load_state import LoadState
from policies.cost import RequestCost
from policies.decision import Admit
from policies.step_time import StepTimeModel
from tests.support.admission import state_doc

# the sim's own timing model (llama-7b on h100-80g): the engine's steps take this, plus host time
PRIOR = StepTimeModel(base_s=0.004138903457706135, per_prefill_token_s=1.8583409890362372e-05,
                      per_decode_seq_s=4.181908280928126e-06,
                      per_context_token_s=3.904080744246803e-08)
DATA = Path(__file__).with_name("data") / "short_request_iterations.json"
NUM_BURST = 200


def sim_doc(iterations=()) -> dict:
    """An idle llama-7b sim replica on an H100 (the battery's), with recent iterations."""
    doc = state_doc(num_free_blocks=29132, max_model_len=4096)
    doc.update(max_num_seqs=256, max_num_batched_tokens=2048, iterations=list(iterations),
               timing_model={"step_time_prior": dict(zip(
                   ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s"),
                   PRIOR.as_tuple(), strict=True))})
    return doc


def short_request_iterations() -> list[dict]:
    """256 iterations recorded from that window (see the data file's ``about``)."""
    rows = json.loads(DATA.read_text())["iterations"]
    return [dict(zip(("batch_id", "num_prefill_tokens", "num_decode_seqs",
                      "num_context_tokens", "duration_s"), row, strict=True)) for row in rows]


def admitted_of_burst(warm: bool) -> int:
    load_state = LoadState()
    if warm:
        load_state.update_from_kvguard_state("local", sim_doc(short_request_iterations()), 10.0)
    load_state.update_from_kvguard_state("local", sim_doc(), 15.0)  # idle since
    now = [15.0]
    guard = AdmissionController(GuardConfig(), registry=CollectorRegistry(), clock=lambda: now[0],
                                load_state=load_state, rng=random.Random(1))
    interactive = guard.config.request_class("interactive")
    num_admitted = 0
    for i in range(NUM_BURST):  # all within 0.1 s: before any state refresh
        now[0] = 15.0 + i * 0.0005
        cost = RequestCost(request_id=f"b{i}", tenant="acme", request_class=interactive,
                           num_prompt_tokens=512, max_tokens=256, num_expected_output_tokens=256,
                           num_blocks=math.ceil(768 / 16), arrival_s=now[0],
                           deadline_s=now[0] + interactive.ttft_s)
        num_admitted += isinstance(guard.decider.decide(cost, now[0]), Admit)
    return num_admitted


def test_a_burst_after_short_requests_is_admitted_as_far_as_on_a_fresh_guard():
    fresh = admitted_of_burst(warm=False)
    warm = admitted_of_burst(warm=True)
    assert 0 < fresh < NUM_BURST  # the replica's prefill capacity bounds the burst
    assert warm >= 0.85 * fresh, (warm, fresh)
