"""The guard's running expense: ``kvguard_cost_dollars_total{component[, class, tenant]}``.

The counter accrues from the guard's start at the ``[cost]`` prices: ``accelerator`` for every
configured replica (one when the guard wraps its app in-process), ``host`` for those replicas
and this guard process, ``idle_reserve`` for the warm spare replicas, and ``network`` for the
request and response body bytes of every admitted request. ``network`` is the one component
the guard can put on a request, so its samples carry ``class`` and ``tenant`` (the same bounded
tenant label as the outcome counters); the time-accrued ones carry ``component`` alone. Cost
per good request over any range is one PromQL division::

    sum(increase(kvguard_cost_dollars_total[5m])) / sum(increase(kvguard_goodput_total[5m]))

and a tenant's network spend ``sum by (tenant) (kvguard_cost_dollars_total{component="network"})``.

No busy/idle split of the accelerator here: the guard sees each replica's queue and KV state
and its requests' streams, not the engine's steps, and none of the engine metrics it reads
(vLLM's, SGLang's, TGI's, llama.cpp's, kvguard engine's state page) counts busy accelerator
time; several requests share every step, so their stream times do not add up to it either.
That split, per-request accelerator attribution and energy need the engine's step trace:
``kvguard cost`` (``chaos.cost``), per window.
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
        self._bytes_by: dict[tuple[str, str], int] = {}  # (class, tenant label) -> bytes

    def add_bytes(self, num_bytes: int, class_name: str = "", tenant: str = "") -> None:
        """Count ``num_bytes`` at the guard for a request of ``class_name`` and ``tenant`` (a
        bounded label: the caller's ``tenant_label``)."""
        self.num_bytes += num_bytes
        key = (class_name, tenant)
        self._bytes_by[key] = self._bytes_by.get(key, 0) + num_bytes

    def network_dollars(self) -> dict[tuple[str, str], float]:
        """The network component by (class, tenant)."""
        price = self.config.network_usd_per_byte
        return {key: n * price for key, n in self._bytes_by.items()}

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
                                     "US dollars, at the [cost] prices; network by class and "
                                     "tenant")
        name = "kvguard_cost_dollars_total"
        for component, value in self.dollars().items():
            if component != "network":
                family.add_sample(name, {"component": component}, value)
        network = self.network_dollars()
        if not network:  # nothing relayed yet: the series exists, at 0
            family.add_sample(name, {"component": "network"}, 0.0)
        for (class_name, tenant), value in sorted(network.items()):
            family.add_sample(name, {"component": "network", "class": class_name,
                                     "tenant": tenant}, value)
        yield family
