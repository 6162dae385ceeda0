"""The guard's running expense: ``kvguard_cost_dollars_total{component}``.

The counter accrues from the guard's start at the ``[cost]`` prices: ``accelerator`` for every
configured replica (one when the guard wraps its app in-process), ``host`` for those replicas
and this guard process, ``idle_reserve`` for the warm spare replicas, and ``network`` for the
request and response body bytes of every admitted request. So cost per good request over any
range is one PromQL division::

    increase(kvguard_cost_dollars_total[5m]) / ignoring(component) group_left
        sum(increase(kvguard_goodput_total[5m]))

The split of the accelerator into busy and idle time, per-request attribution and energy need
the engine's step trace: that is ``kvguard cost`` (``chaos.cost``), per window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily

from guard.observe.cost_config import CostConfig

__all__ = ["CostMeter", "METER_COMPONENTS"]

METER_COMPONENTS = ("accelerator", "host", "network", "idle_reserve")


class CostMeter:
    def __init__(self, config: CostConfig, num_replicas: int, num_guards: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_replicas < 0 or num_guards < 0:
            raise ValueError("num_replicas and num_guards must be >= 0")
        self.config = config
        self._num_replicas, self._num_guards = num_replicas, num_guards
        self._clock = clock
        self._started_s = clock()
        self.num_bytes = 0

    def add_bytes(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes

    def dollars(self) -> dict[str, float]:
        """Each component's expense since the guard started."""
        elapsed_s = max(self._clock() - self._started_s, 0.0)
        cfg = self.config
        return {
            "accelerator": self._num_replicas * elapsed_s * cfg.accelerator_usd_per_s,
            "host": (self._num_replicas + self._num_guards) * elapsed_s * cfg.host_usd_per_s,
            "network": self.num_bytes * cfg.network_usd_per_byte,
            "idle_reserve": elapsed_s * cfg.reserve_usd_per_s,
        }

    def families(self) -> Iterator:
        family = CounterMetricFamily("kvguard_cost_dollars", "Expense since the guard started, "
                                     "US dollars, at the [cost] prices", labels=("component",))
        for component, value in self.dollars().items():
            family.add_metric((component,), value)
        yield family
