"""Per model where it matters: with model routing (the proxy's ``replicas_for``), a request is
checked against the context of the replicas serving its model, and its retries are counted
against its model's retry budget, not the fleet's (AdmissionController, no HTTP)."""

import asyncio
import json

from prometheus_client import CollectorRegistry

from guard.admission.admitted import Admitted
from guard.admission.shedding import Rejection
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.replicas.load_state import LoadState
from policies.decision import Admit, Shed
from tests.support.admission import FakeClock, admit, state_doc

GROUPS = {"model-a": frozenset({"a0"}), "model-b": frozenset({"b0"})}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class FirstReplica:
    """Admits to the first replica offered (sheds everything when ``shed``)."""

    name = "first"
    observes_completions = False

    def __init__(self, shed=False):
        self.shed = shed
        self.offered = []

    def decide(self, cost, snapshot):
        self.offered.append(tuple(r.replica_id for r in snapshot.replicas))
        if self.shed:
            return Shed(503, "overloaded")
        return Admit(snapshot.replicas[0].replica_id, predicted_ttft_s=0.1)

    def admitted(self, cost, replica_id, now_s):
        pass

    def observe(self, sample):
        pass


def make_controller(policy, lengths=None, **config):
    clock = FakeClock(1.0)
    load_state = LoadState()
    lengths = lengths or {"a0": 512, "b0": 4096}
    for model, (rid,) in GROUPS.items():
        doc = state_doc(max_model_len=lengths[rid])
        doc["model"] = model
        load_state.update_from_kvguard_state(rid, doc, clock())
    controller = AdmissionController(GuardConfig.from_dict(config), registry=CollectorRegistry(),
                                     clock=clock, policy=policy, load_state=load_state)
    controller.replicas_for = lambda model: GROUPS.get(model)
    controller._update_limits()  # what a state refresh does
    return controller


def body(model, num_prompt_tokens=8, max_tokens=8):
    return json.dumps({"model": model, "prompt": list(range(num_prompt_tokens)),
                       "max_tokens": max_tokens}).encode()


def test_a_prompt_over_one_models_context_fits_a_bigger_models():
    async def main():
        controller = make_controller(FirstReplica())
        refused = await admit(controller, "/v1/completions", {}, body("model-a", 1000))
        assert isinstance(refused, Rejection) and refused.status == 400
        assert refused.reason == "context_length_exceeded" and "512" in refused.message
        admitted = await admit(controller, "/v1/completions", {}, body("model-b", 1000))
        assert isinstance(admitted, Admitted) and admitted.replica_id == "b0"
        admitted.finish()
        # a model's /v1/models entry (the proxy's catalog) outranks the state's length
        controller.replica_limits.model_context = lambda rid, model: 2048 if rid == "a0" else None
        controller._update_limits()
        listed = await admit(controller, "/v1/completions", {}, body("model-a", 1000))
        assert isinstance(listed, Admitted) and listed.replica_id == "a0"
        listed.finish()
        await controller.aclose()
    run(main())


def test_without_model_routing_the_smallest_context_holds():
    async def main():
        controller = make_controller(FirstReplica())
        controller.replicas_for = None
        refused = await admit(controller, "/v1/completions", {}, body("model-b", 1000))
        assert isinstance(refused, Rejection) and refused.reason == "context_length_exceeded"
        await controller.aclose()
    run(main())


def test_a_retry_storm_on_one_model_leaves_the_others_retry_budget():
    """Everything is shed. Model A: 10 first attempts allow max(3, 10 %) = 3 advised retries,
    then its sheds say "do not retry"; 4 retries that come anyway put A over its budget. Model
    B's sheds still advise retrying (within B's own allowance), and its retries are not over
    budget (a fleet-wide budget would say "do not retry" and "over" to all of them)."""
    async def main():
        over = []

        class Spy(FirstReplica):
            def decide(self, cost, snapshot):
                over.append(snapshot.retry_budget.is_over(cost.tenant))
                return super().decide(cost, snapshot)

        controller = make_controller(Spy(shed=True))
        retry = {"x-stainless-retry-count": "1"}
        advice = []
        for model, headers in [("model-a", {})] * 10 + [("model-a", retry)] * 4 \
                + [("model-b", retry)] * 3:
            shed = await admit(controller, "/v1/completions", headers, body(model))
            assert isinstance(shed, Rejection) and shed.status == 503
            advice.append(shed.should_retry)
        # B's own allowance: 3 retries, and the third one seen uses it up
        assert advice == [True] * 3 + [False] * 11 + [True, True, False]
        assert over == [False] * 13 + [True] + [False] * 3
        await controller.aclose()
    run(main())
