"""guard.request.deadline: the client's deadline, one reading for pricing and retry advice."""

import math
import random

import pytest
from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.errors import PricingError
from guard.request.deadline import client_timeout_s
from policies.decision import Shed
from tests.support.admission import FakeClock, SlotPolicy, make_cost

OWN = "x-kvguard-deadline-ms"
SDK = "x-stainless-read-timeout"


@pytest.mark.parametrize(("headers", "expected_s"), [
    ({}, None),
    ({SDK: "30"}, 30.0),
    ({OWN: "500"}, 0.5),
    ({SDK: "30", OWN: "500"}, 0.5),  # the shorter one holds, whichever header it is in
    ({SDK: "0.2", OWN: "500"}, 0.2),
    ({SDK: "soon"}, None),  # the SDK's hint, malformed: ignored
    ({SDK: "soon", OWN: "500"}, 0.5),
    ({SDK: "0"}, None), ({SDK: "-3"}, None), ({SDK: "inf"}, None), ({SDK: "nan"}, None),
])
def test_the_shortest_valid_deadline_in_seconds(headers, expected_s):
    assert client_timeout_s(headers, OWN) == expected_s


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "inf", "nan", ""])
def test_a_malformed_own_deadline_header_is_a_400_naming_it(bad):
    with pytest.raises(PricingError) as info:
        client_timeout_s({SDK: "30", OWN: bad}, OWN)
    assert (info.value.status, info.value.reason, info.value.param) == (400, "invalid_header", OWN)


def test_the_header_name_is_the_configured_one():
    assert client_timeout_s({"x-my-deadline": "250"}, "x-my-deadline") == 0.25
    assert client_timeout_s({OWN: "250"}, "x-my-deadline") is None


def test_pricing_and_retry_advice_read_the_same_deadline():
    """Both headers sent, the guard's own one shorter: pricing sets the deadline from it, and
    retry advice (whose wait is at least the 1 s turnover) says do not retry, since the client
    gives up after 0.5 s. (Retry advice once read the SDK's 30 s alone and advised a retry.)"""
    controller = AdmissionController(GuardConfig(), registry=CollectorRegistry(),
                                     clock=FakeClock(10.0), policy=SlotPolicy(),
                                     rng=random.Random(5))
    headers = {SDK: "30", OWN: "500"}
    timeout_s = client_timeout_s(headers, OWN)
    assert timeout_s == 0.5 and not math.isinf(timeout_s)
    rejection = controller.rejecter.shed(make_cost(arrival_s=10.0),
                                         Shed(503, "overloaded", retry_after_s=None),
                                         headers, None)
    assert not rejection.should_retry and rejection.retry_after_s is None
    sdk_only = controller.rejecter.shed(make_cost(arrival_s=10.0),
                                        Shed(503, "overloaded", retry_after_s=None),
                                        {SDK: "30"}, None)
    assert sdk_only.should_retry and sdk_only.retry_after_s is not None
