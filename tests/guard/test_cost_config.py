"""The [cost] table: defaults, prices per second, and bad values refused with the key named."""

import math

import pytest

from guard.config import GuardConfig
from guard.observe.cost_config import DEFAULT_ACCELERATOR_USD_PER_HOUR, CostConfig


def test_default_accelerator_price_follows_the_gpu_kind():
    assert CostConfig().accelerator_usd_per_s == DEFAULT_ACCELERATOR_USD_PER_HOUR["h100-80g"] / 3600
    assert CostConfig(gpu="a100-80g").accelerator_usd_per_s == 1.99 / 3600
    assert CostConfig(accelerator_usd_per_hour=7.2).accelerator_usd_per_s == pytest.approx(0.002)


def test_reserve_is_priced_at_accelerator_plus_host():
    cfg = CostConfig(accelerator_usd_per_hour=3.6, host_usd_per_hour=0.36, idle_reserve_replicas=2)
    assert cfg.reserve_usd_per_s == pytest.approx(2 * (0.001 + 0.0001))


def test_guard_config_reads_the_cost_table():
    cfg = GuardConfig.from_dict({"cost": {"gpu": "h200", "network_usd_per_gb": 0.09}})
    assert cfg.cost.gpu == "h200"
    assert cfg.cost.network_usd_per_byte == pytest.approx(0.09e-9)
    assert GuardConfig().cost == CostConfig()


@pytest.mark.parametrize("key,value", [
    ("accelerator_usd_per_hour", -1.0), ("host_usd_per_hour", math.nan),
    ("network_usd_per_gb", math.inf), ("energy_usd_per_kwh", -0.1),
    ("idle_reserve_replicas", -1), ("idle_reserve_replicas", 1.5), ("host_usd_per_hour", "1"),
    ("host_usd_per_hour", True), ("gpu", "tpu-v5"),
])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^cost\.{key}:"):
        GuardConfig.from_dict({"cost": {key: value}})


def test_unknown_key_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^cost\.accelerator_usd_per_hr: unknown key"):
        GuardConfig.from_dict({"cost": {"accelerator_usd_per_hr": 2.0}})
    with pytest.raises(ValueError, match=r"^cost: must be a table"):
        GuardConfig.from_dict({"cost": 3})
