"""One side of a ``kvguard review``: a fleet file.

    name = "faster-decode"
    replicas = 2
    [engine]
    model = "llama-7b"                # a model preset
    gpu = "h100-80g"                  # the sim's GPU (and the default accelerator price)
    num_blocks = 4000                 # KV blocks per replica (default: what the GPU holds)
    max_num_batched_tokens = 1024
    max_num_seqs = 256
    enable_prefix_caching = true
    step_time_factor = 0.8            # sim step time × this: a kernel 20 % faster
    [guard]                           # the proxy's guard config (policy, policy_params, ...)
    policy = "slo"
    [cost]                            # prices (guard.observe.cost_config)

The engine backend is the sim (``backend = "sim"``, the only one a review can run many
times on a CPU). Unknown keys are refused with the key named; so are bad values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from guard.config import GuardConfig
from guard.observe.cost_config import CostConfig

__all__ = ["EngineFlags", "FleetSpec", "load_fleet"]

_ENGINE_KEYS = {"backend", "model", "gpu", "num_blocks", "max_num_batched_tokens",
                "max_num_seqs", "enable_prefix_caching", "step_time_factor"}
_TOP_KEYS = {"name", "replicas", "engine", "guard", "cost"}


@dataclass(frozen=True)
class EngineFlags:
    backend: str = "sim"
    model: str = "llama-7b"
    gpu: str = "h100-80g"
    num_blocks: int | None = None
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    step_time_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.backend != "sim":
            raise ValueError(f"engine.backend: a review runs the sim backend, got {self.backend!r}")
        for key in ("model", "gpu"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"engine.{key}: must be a string")
        for key in ("max_num_batched_tokens", "max_num_seqs", "num_blocks"):
            value = getattr(self, key)
            if value is None and key == "num_blocks":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine.{key}: must be an integer >= 1, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("engine.enable_prefix_caching: must be true or false")
        f = self.step_time_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"engine.step_time_factor: must be a number > 0, got {f!r}")

    def args(self, time_scale: float) -> tuple[str, ...]:
        """``kvguard engine`` flags; the sim waits ``time_scale × step_time_factor`` wall
        seconds per modelled second, so the factor is a kernel that is that much faster."""
        return ("--model", self.model, "--backend", "sim", "--gpu", self.gpu,
                "--time-scale", repr(time_scale * self.step_time_factor),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                *(() if self.num_blocks is None else ("--num-blocks", str(self.num_blocks))),
                "--enable-prefix-caching" if self.enable_prefix_caching
                else "--no-enable-prefix-caching")


@dataclass(frozen=True)
class FleetSpec:
    name: str
    replicas: int = 2
    engine: EngineFlags = field(default_factory=EngineFlags)
    guard: Mapping[str, Any] = field(default_factory=dict)
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name: must be a non-empty string")
        r = self.replicas
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"replicas: must be an integer >= 1, got {r!r}")
        GuardConfig.from_dict(self.guard)  # refused here, not when the proxy starts

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], default_name: str = "fleet") -> FleetSpec:
        unknown = sorted(set(data) - _TOP_KEYS)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown fleet key")
        engine = data.get("engine", {})
        if not isinstance(engine, Mapping):
            raise ValueError("engine: must be a table")
        bad = sorted(set(engine) - _ENGINE_KEYS)
        if bad:
            raise ValueError(f"engine.{bad[0]}: unknown key")
        guard = data.get("guard", {})
        if not isinstance(guard, Mapping):
            raise ValueError("guard: must be a table")
        cost = CostConfig.from_dict({"gpu": engine.get("gpu", "h100-80g"), **data.get("cost", {})})
        return cls(data.get("name", default_name), data.get("replicas", 2),
                   EngineFlags(**engine), dict(guard), cost)


def load_fleet(path: str | Path) -> FleetSpec:
    """Read and validate a fleet file; ValueError names the file and the key."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None
    try:
        return FleetSpec.from_dict(data, Path(path).stem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
