"""One rule for every number a user sets in the guard budget, proxy and server-limit configs."""

import math

import pytest

from guard.budget.config import BudgetConfig
from guard.proxy.config import ProxyConfig
from serving.checks import require_count, require_seconds
from serving.server_limits import ServerLimits


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5", None])
def test_seconds_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match=r"^x\.t_s: must be a finite number of seconds > 0"):
        require_seconds("x.t_s", bad)


def test_seconds_may_be_zero_where_allowed():
    require_seconds("x", 0, allow_zero=True)
    require_seconds("x", 2.5)
    with pytest.raises(ValueError, match=">= 0"):
        require_seconds("x", -0.1, allow_zero=True)


@pytest.mark.parametrize("bad", [0, 1.0, True, "3"])
def test_counts_are_integers_not_bools(bad):
    with pytest.raises(ValueError, match=r"^n: must be an integer >= 1, got"):
        require_count("n", bad)
    require_count("n", 0, minimum=0)


@pytest.mark.parametrize("make", [
    lambda: ProxyConfig(read_timeout_s=math.inf),
    lambda: BudgetConfig(lease_s=math.nan),
    lambda: ServerLimits(header_timeout_s=math.inf),
    lambda: ProxyConfig(eject_after_failures=True),
    lambda: ServerLimits(max_connections=-1),
])
def test_every_config_uses_the_shared_rule(make):
    with pytest.raises(ValueError, match="must be"):
        make()
