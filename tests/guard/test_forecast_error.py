"""ForecastError: predicted ÷ actual TTFT over a sliding window."""

import pytest

from guard.observe.forecast_error import ForecastError


def test_summary_reports_median_p90_and_median_absolute_error():
    e = ForecastError()
    assert e.summary() is None
    for predicted_s, actual_s in [(1.0, 1.0), (0.5, 1.0), (1.2, 1.0), (2.0, 1.0), (0.9, 1.0)]:
        e.observe(predicted_s, actual_s)
    s = e.summary()
    assert s.num_samples == 5
    assert s.median_ratio == pytest.approx(1.0)  # ratios 0.5 0.9 1.0 1.2 2.0
    assert s.p90_ratio == pytest.approx(1.2 + 0.6 * 0.8)
    assert s.median_abs_error_ratio == pytest.approx(0.2)  # errors 0 0.1 0.2 0.5 1.0


def test_missing_or_nonpositive_samples_are_ignored_and_the_window_slides():
    e = ForecastError(window=2)
    for predicted_s, actual_s in [(None, 1.0), (1.0, None), (0.0, 1.0), (1.0, 0.0)]:
        e.observe(predicted_s, actual_s)
    assert e.summary() is None
    for ratio in (3.0, 1.0, 2.0):
        e.observe(ratio, 1.0)
    assert e.summary().num_samples == 2 and e.summary().median_ratio == pytest.approx(1.5)


def test_bad_window_is_a_value_error():
    with pytest.raises(ValueError):
        ForecastError(window=0)
