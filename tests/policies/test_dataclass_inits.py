"""The per-request frozen dataclasses with a hand-written ``__init__`` (one dict store per
field instead of ``object.__setattr__``) keep the dataclass's fields, order and defaults, and
stay frozen, equal by value and hashable."""

import dataclasses
import inspect

import pytest

from policies.cost import RequestClass, RequestCost
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot
from policies.step_time import StepTimeModel

FAST_INIT = (RequestCost, LoadSnapshot)


def init_matches_fields(cls) -> None:
    """Shared with tests/guard/test_pricing.py (PricedRequest)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = dataclasses.fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for param, field in zip(params, fields, strict=True):
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert param.default == default, field.name


@pytest.mark.parametrize("cls", FAST_INIT)
def test_init_takes_exactly_the_fields_in_order_with_their_defaults(cls):
    init_matches_fields(cls)


def test_instances_stay_frozen_comparable_hashable_and_replaceable():
    klass = RequestClass("interactive", 1.0, 0.08)
    cost = RequestCost("r1", "acme", klass, 10, 16, 8, 2, 0.0, 1.0)
    same = RequestCost(request_id="r1", tenant="acme", request_class=klass, num_prompt_tokens=10,
                       max_tokens=16, num_expected_output_tokens=8, num_blocks=2, arrival_s=0.0,
                       deadline_s=1.0, is_retry=False)
    assert cost == same and hash(cost) == hash(same) and not cost.is_retry
    assert dataclasses.replace(cost, is_retry=True).is_retry
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.num_blocks = 3  # type: ignore[misc]
    snapshot = LoadSnapshot(1.0, (), StepTimeModel(0.01, 1e-4, 1e-4, 1e-7))
    assert snapshot.queued_ahead is NOTHING_AHEAD and snapshot.num_queued == 0
    assert dataclasses.replace(snapshot, num_queued=3).num_queued == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.now_s = 2.0  # type: ignore[misc]
