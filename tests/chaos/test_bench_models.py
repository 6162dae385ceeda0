"""``kvguard bench models``: the mixed two-model stream and the misroute count (pure parts;
the bench itself runs real processes and is recorded in docs/benchmarks.md §19)."""

import argparse
import json

from chaos.bench import models


def _scenarios(seed=0):
    p = argparse.ArgumentParser()
    models.configure(p)
    args = p.parse_args(["--seed", str(seed), "--duration", "4", "--time-scale", "1"])
    return {models.MODELS[0]: models._scenario(args, "a100-80g", None),
            models.MODELS[1]: models._scenario(args, "h100-80g", 500)}


def test_each_model_arrives_at_its_own_rate_merged_in_time_and_named_in_its_body():
    scenarios = _scenarios()
    assert scenarios["model-b"].args.num_blocks == 500 and scenarios["model-a"].args.gpu == \
        "a100-80g"
    specs, bodies, model_of = models._mixed_stream(scenarios, {"model-a": 5.0, "model-b": 20.0},
                                                   load=1.0)
    assert [s.index for s in specs] == list(range(len(specs)))
    assert [s.scheduled_s for s in specs] == sorted(s.scheduled_s for s in specs)
    counts = {m: sum(1 for i in model_of if model_of[i] == m) for m in models.MODELS}
    assert 8 <= counts["model-a"] <= 40 and 50 <= counts["model-b"] <= 120  # ~20 and ~80
    for spec, body in zip(specs, bodies, strict=True):
        sent = json.loads(body)
        assert sent["model"] == model_of[spec.index] and sent["max_tokens"] == spec.max_tokens
    # the same seed gives the same stream; the two models' prompts differ
    again = models._mixed_stream(_scenarios(), {"model-a": 5.0, "model-b": 20.0}, load=1.0)
    assert again[1] == bodies


def test_misroutes_are_admits_on_a_replica_of_another_model(tmp_path):
    trace = tmp_path / "guard-trace.jsonl"
    lines = [{"model": "model-a", "replica": "r0"}, {"model": "model-a", "replica": "r2"},
             {"model": "model-b", "replica": "r3"}, {"model": "model-b", "replica": None}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    owner = {"r0": "model-a", "r1": "model-a", "r2": "model-b", "r3": "model-b"}
    assert models._misrouted(trace, owner) == {"model-a": 1}
    assert models._misrouted(tmp_path / "none.jsonl", owner) == {}
