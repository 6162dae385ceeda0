"""LoopLag: lateness of a periodic timer, with an injected clock and sleep (no real waiting)."""

import asyncio
import time

import pytest

from guard.observe.loop_lag import LoopLag


def test_records_how_late_each_wakeup_was_and_the_largest():
    now = [0.0]
    oversleep = iter([0.0, 0.060, 0.002])
    seen = []

    async def sleep(interval_s):
        now[0] += interval_s + next(oversleep)  # the loop was busy this much longer

    lag = LoopLag(0.01, clock=lambda: now[0], sleep=sleep, on_sample=seen.append)
    asyncio.run(lag.run(max_samples=3))
    assert seen == pytest.approx([0.0, 0.060, 0.002])
    assert lag.max_lag_s == pytest.approx(0.060) and lag.num_samples == 3


def test_a_clock_that_steps_back_is_not_negative_lag():
    lag = LoopLag()
    lag.record(-0.5)
    assert lag.max_lag_s == 0.0 and lag.num_samples == 1


def test_bad_interval_is_a_value_error():
    with pytest.raises(ValueError):
        LoopLag(0.0)


def test_start_samples_from_a_timer_on_the_running_loop_until_stop():
    async def main() -> None:
        lag = LoopLag(0.001)
        lag.start()
        for _ in range(6000):  # hang guard
            if lag.num_samples >= 3:
                break
            await asyncio.sleep(0.005)
        time.sleep(0.05)  # the loop is blocked: the next sample is at least this late
        await asyncio.sleep(0.005)
        assert lag.max_lag_s >= 0.04
        lag.stop()
        taken = lag.num_samples
        await asyncio.sleep(0.02)
        assert lag.num_samples == taken  # no timer left

    asyncio.run(main())
