"""Seeded arrival schedules: reproducible, right mean rate, right shapes and mix."""

import statistics

import pytest

from chaos.schedule import (
    ClassShare,
    LengthDist,
    ScheduleConfig,
    arrival_times,
    build_schedule,
    prompt_token_ids,
)


def _cfg(**kw):
    base = dict(rate_per_s=50.0, duration_s=20.0, seed=7,
                prompt_tokens=LengthDist.parse("64:512"),
                output_tokens=LengthDist.parse("ln:100:0.8:1000"),
                classes=(ClassShare("interactive", 3.0), ClassShare("batch", 1.0)),
                num_tenants=4)
    base.update(kw)
    return ScheduleConfig(**base)


def test_same_seed_same_schedule_and_prompts():
    a, b = build_schedule(_cfg()), build_schedule(_cfg())
    assert a == b
    assert prompt_token_ids(7, a[5]) == prompt_token_ids(7, b[5])
    c = build_schedule(_cfg(seed=8))
    assert [s.scheduled_s for s in a] != [s.scheduled_s for s in c]


def test_poisson_mean_rate_and_exponential_gaps():
    times = arrival_times(ScheduleConfig(rate_per_s=100.0, duration_s=200.0, seed=1))
    # 20 000 expected arrivals: sd of the count is sqrt(20000) ~ 141, so 3 % is > 4 sigma.
    assert 19_400 < len(times) < 20_600
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.01, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.05)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200.0


def test_constant_shape_is_evenly_spaced():
    times = arrival_times(ScheduleConfig(rate_per_s=4.0, duration_s=2.0, shape="constant"))
    assert times == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]


def test_burst_shape_raises_the_rate_only_inside_the_window():
    cfg = ScheduleConfig(rate_per_s=20.0, duration_s=300.0, shape="burst", seed=3,
                         burst_rate_per_s=200.0, burst_start_s=100.0, burst_duration_s=50.0)
    times = arrival_times(cfg)
    inside = sum(100.0 <= t < 150.0 for t in times)
    outside = len(times) - inside
    assert 10_000 * 0.95 < inside < 10_000 * 1.05        # 200/s for 50 s
    assert 5_000 * 0.93 < outside < 5_000 * 1.07          # 20/s for 250 s
    assert cfg.expected_count() == pytest.approx(15_000)


def test_mix_sizes_classes_and_tenants():
    specs = build_schedule(_cfg(duration_s=40.0))
    assert all(64 <= s.num_prompt_tokens <= 512 for s in specs)
    assert all(1 <= s.max_tokens <= 1000 for s in specs)
    assert statistics.median(s.max_tokens for s in specs) == pytest.approx(100, rel=0.15)
    share = sum(s.request_class == "interactive" for s in specs) / len(specs)
    assert share == pytest.approx(0.75, abs=0.05)
    assert {s.tenant for s in specs} == {f"chaos-tenant-{i}" for i in range(4)}
    assert [s.index for s in specs] == list(range(len(specs)))


def test_prompt_ids_have_the_planned_length_and_a_safe_range():
    spec = build_schedule(_cfg())[0]
    ids = prompt_token_ids(7, spec)
    assert len(ids) == spec.num_prompt_tokens
    assert all(1000 <= t < 20000 for t in ids)


@pytest.mark.parametrize("text", ["0", "5:2", "ln:0:1:10", "abc", "1:2:3"])
def test_bad_lengths_are_refused(text):
    with pytest.raises(ValueError):
        LengthDist.parse(text)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="shape"):
        ScheduleConfig(rate_per_s=1.0, duration_s=1.0, shape="zigzag")
    with pytest.raises(ValueError, match="burst"):
        ScheduleConfig(rate_per_s=1.0, duration_s=1.0, shape="burst")
    with pytest.raises(ValueError):
        ScheduleConfig(rate_per_s=0.0, duration_s=1.0)


def test_explicit_tenant_keys_replace_generated_ones():
    specs = build_schedule(_cfg(tenant_keys=("key-a", "key-b")))
    assert {s.tenant for s in specs} == {"key-a", "key-b"}
    with pytest.raises(ValueError, match="tenant_keys"):
        _cfg(tenant_keys=("",))
