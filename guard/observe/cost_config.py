"""The ``[cost]`` table: what one replica, one guard process and one gigabyte cost.

Keys (every one optional; unknown keys, negative numbers, NaN and infinity are refused with
the key named)::

    [cost]
    gpu = "h100-80g"                  # picks the default accelerator price below
    accelerator_usd_per_hour = 3.24   # per replica (default: the gpu's list price)
    host_usd_per_hour = 0.0           # per replica and per guard/proxy process
    network_usd_per_gb = 0.0          # bytes in + out at the guard, per 10^9 bytes
    idle_reserve_replicas = 0         # warm, unused replicas kept for a replica loss
    energy_usd_per_kwh = 0.0          # optional: prices the replicas' energy on top

Default accelerator prices (US dollars per GPU-hour, on demand, no commitment), the middle of
the public range a price survey reports, so that a report without a ``[cost]`` table still has
a plausible scale. They are list prices, not what any one operator pays: set
``accelerator_usd_per_hour`` for real accounting.

* ``a100-80g`` 1.99 and ``h100-80g`` 3.24: the middles of "typical on-demand range" A100 80GB
  SXM $1.49–2.49 and H100 SXM $2.49–3.99 per hour (pricegpu.pages.dev, "H100 vs A100 Cloud
  Pricing", early 2026; read 2026-12-06).
* ``h200`` 3.59: RunPod's H200 on-demand price quoted by deploybase.ai, "A100 vs H200"
  (2025-10-15; read 2026-12-06).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CostConfig", "DEFAULT_ACCELERATOR_USD_PER_HOUR", "COMPONENTS"]

DEFAULT_ACCELERATOR_USD_PER_HOUR: Mapping[str, float] = {
    "a100-80g": 1.99,
    "h100-80g": 3.24,
    "h200": 3.59,
}
# the expense components every cost report and the kvguard_cost_dollars_total counter split into
COMPONENTS = ("accelerator", "host", "network", "idle_reserve", "energy")
_GB = 1e9


def _require_price(key: str, value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value >= 0
    if not ok:
        raise ValueError(f"cost.{key}: must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CostConfig:
    """Prices, validated on construction. ``accelerator_usd_per_hour`` None: ``gpu``'s default.

    ``energy_usd_per_kwh`` 0 leaves energy out (it is usually inside an accelerator's hourly
    price); set it when the accelerator price is for the hardware alone.
    """

    gpu: str = "h100-80g"
    accelerator_usd_per_hour: float | None = None
    host_usd_per_hour: float = 0.0
    network_usd_per_gb: float = 0.0
    idle_reserve_replicas: int = 0
    energy_usd_per_kwh: float = 0.0

    def __post_init__(self) -> None:
        if self.gpu not in DEFAULT_ACCELERATOR_USD_PER_HOUR:
            raise ValueError(f"cost.gpu: must be one of {sorted(DEFAULT_ACCELERATOR_USD_PER_HOUR)}, "
                             f"got {self.gpu!r}")
        if self.accelerator_usd_per_hour is not None:
            _require_price("accelerator_usd_per_hour", self.accelerator_usd_per_hour)
        for key in ("host_usd_per_hour", "network_usd_per_gb", "energy_usd_per_kwh"):
            _require_price(key, getattr(self, key))
        reserve = self.idle_reserve_replicas
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"cost.idle_reserve_replicas: must be an integer >= 0, got {reserve!r}")

    @property
    def accelerator_usd_per_s(self) -> float:
        """One replica's accelerator price per second (the configured or the gpu's default)."""
        hourly = self.accelerator_usd_per_hour
        if hourly is None:
            hourly = DEFAULT_ACCELERATOR_USD_PER_HOUR[self.gpu]
        return hourly / 3600.0

    @property
    def host_usd_per_s(self) -> float:
        return self.host_usd_per_hour / 3600.0

    @property
    def network_usd_per_byte(self) -> float:
        return self.network_usd_per_gb / _GB

    @property
    def energy_usd_per_joule(self) -> float:
        return self.energy_usd_per_kwh / 3.6e6

    @property
    def reserve_usd_per_s(self) -> float:
        """The idle reserve: accelerator + host of each reserve replica, all the time."""
        return self.idle_reserve_replicas * (self.accelerator_usd_per_s + self.host_usd_per_s)

    @classmethod
    def from_dict(cls, data: Any) -> CostConfig:
        """Build from the ``[cost]`` table; an unknown key raises ValueError naming it."""
        if not isinstance(data, Mapping):
            raise ValueError("cost: must be a table")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cost.{unknown[0]}: unknown key")
        return cls(**dict(data))
