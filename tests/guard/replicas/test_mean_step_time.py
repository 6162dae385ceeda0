"""The mean step-time model kept as running sums equals the mean computed from scratch."""

from __future__ import annotations

import math

import pytest

from guard.replicas.mean_step_time import MeanStepTime
from policies.step_time import StepTimeModel

PRIOR = StepTimeModel(1.0, 1.0, 1.0, 1.0)


def model(k: float) -> StepTimeModel:
    return StepTimeModel(0.01 * k, 1e-4 * k, 1e-3 / k, 1e-8 * k)


def exact(models: list[StepTimeModel]) -> StepTimeModel:
    return StepTimeModel(*(sum(c) / len(models) for c in zip(*(m.as_tuple() for m in models), strict=True)))


def close(a: StepTimeModel, b: StepTimeModel) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(a.as_tuple(), b.as_tuple(), strict=True))


def test_the_mean_follows_refreshes_and_health():
    mean = MeanStepTime()
    assert mean.mean(PRIOR) == PRIOR  # nothing counted
    mean.count("a", model(1))
    mean.count("b", model(2))
    mean.mean(PRIOR)  # summed once; from here on kept as running sums
    mean.count("c", model(3))
    mean.count("a", model(5))  # a refreshed: its old model leaves the sums
    assert close(mean.mean(PRIOR), exact([model(5), model(2), model(3)]))
    mean.count("b", None)  # unhealthy: not counted
    assert len(mean) == 2 and close(mean.mean(PRIOR), exact([model(5), model(3)]))


def test_a_resync_sums_the_models_again():
    mean = MeanStepTime(resync_every=4)
    for i in range(1, 40):
        mean.count(f"r{i % 5}", model(i))
        mean.mean(PRIOR)
    latest = {f"r{i % 5}": model(i) for i in range(1, 40)}
    assert close(mean.mean(PRIOR), exact(list(latest.values())))


def test_resync_every_is_validated():
    with pytest.raises(ValueError, match="resync_every"):
        MeanStepTime(resync_every=0)


def test_the_same_model_again_leaves_the_sums_as_they_were():
    """A refresh that brings no new fit is no change: taking a model out of the sums and
    putting it back rounds (s - a + a is not always s), and the mean would drift from the one
    the same models give summed once."""
    models = {name: StepTimeModel(*[x] * 4) for name, x in (
        ("a", 0.7050030316920598), ("b", 0.9991557362030224), ("c", 0.0008687559141843779))}
    once, again = MeanStepTime(), MeanStepTime()
    for means in (once, again):
        for name, m in models.items():
            means.count(name, m)
        means.sum_up()
    for _ in range(3):
        again.count("a", models["a"])
    assert again.mean(PRIOR) == once.mean(PRIOR)
