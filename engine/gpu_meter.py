"""What the accelerator did: model work per step, where its memory went, power and energy.

Work is the roofline's (``engine.timing_model.step_cost``): FLOPs and HBM bytes of each step's
shape, whatever the backend, so the counters say what the model asked of the device. Memory is
the capacity planner's split (``engine.planner``): weights, the KV pool, the activation
workspace and the runtime reserve.

Power and energy have two sources, exported with a ``source`` label:

- ``measured``: on CUDA with NVML reachable (``pynvml``, the ``nvidia-ml-py`` package), the
  board's power draw and its cumulative energy counter;
- ``modelled``: elsewhere (the sim and CPU backends), ``idle + (max − idle) × utilisation``
  with the GPU table's power figures, where a step's utilisation is its roofline time (the
  larger of its memory and compute time at peak) ÷ its wall time, and the time between steps
  is idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.gpus import GPUSpec
from engine.outputs import RequestWork
from engine.planner import RUNTIME_RESERVE_BYTES, activation_bytes
from engine.timing_model import StepShape, step_cost

__all__ = ["MemorySplit", "GpuMeter", "NvmlPower", "nvml_power", "shape_of"]


@dataclass(frozen=True)
class MemorySplit:
    """Device memory by use, bytes."""

    weights_bytes: int
    kv_bytes: int
    workspace_bytes: int
    reserve_bytes: int

    @classmethod
    def plan(cls, model: ModelConfig, num_blocks: int, block_size: int,
             max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int = 2) -> MemorySplit:
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes
        return cls(model.num_params * dtype_bytes, num_blocks * block_size * per_token,
                   activation_bytes(model, max_num_batched_tokens, max_num_seqs, dtype_bytes),
                   RUNTIME_RESERVE_BYTES)

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights_bytes, "kv": self.kv_bytes,
                "workspace": self.workspace_bytes, "reserve": self.reserve_bytes}


def shape_of(work: tuple[RequestWork, ...]) -> StepShape:
    """A step's roofline shape from its per-request work."""
    prefill = [w for w in work if w.num_prefill_tokens]
    decode = [w for w in work if w.num_decode_tokens]
    pairs = sum(w.num_prefill_tokens * w.num_kv_read_tokens
                + w.num_prefill_tokens * (w.num_prefill_tokens + 1) // 2 for w in prefill)
    return StepShape(num_prefill_tokens=sum(w.num_prefill_tokens for w in prefill),
                     num_decode_seqs=len(decode),
                     num_context_tokens=sum(w.num_kv_read_tokens for w in decode),
                     num_prefill_cached_tokens=sum(w.num_kv_read_tokens for w in prefill),
                     num_prefill_attention_pairs=pairs)


class NvmlPower:
    """The board's power (W) and cumulative energy (J) through NVML."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle

    def power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # milliwatts

    def energy_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0  # mJ


def nvml_power(device_index: int = 0) -> NvmlPower | None:
    """NVML for CUDA device ``device_index``, or None where there is no CUDA or no NVML."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        import pynvml

        pynvml.nvmlInit()
        return NvmlPower(pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index))
    except Exception:  # no torch, no pynvml, no driver: the power is modelled instead
        return None


class GpuMeter:
    """Counts one replica's model work and energy; read by ``EngineMetrics`` at scrape time."""

    def __init__(self, model: ModelConfig, gpu: GPUSpec, memory: MemorySplit,
                 measured: NvmlPower | None = None, dtype_bytes: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.gpu, self.memory = model, gpu, memory
        self._measured, self._dtype_bytes, self._clock = measured, dtype_bytes, clock
        self.flops = 0.0
        self.hbm_bytes = 0.0
        self._started_s = clock()
        self._energy_at_start_j = measured.energy_j() if measured is not None else 0.0
        self._active_j = 0.0  # modelled energy above idle, summed over steps
        self._last_power_w = gpu.idle_power_w

    @property
    def source(self) -> str:
        return "measured" if self._measured is not None else "modelled"

    def on_step(self, work: tuple[RequestWork, ...], duration_s: float) -> None:
        """One executed step: add its work and (modelled) the energy above idle."""
        cost = step_cost(self.model, shape_of(work), self._dtype_bytes)
        self.flops += cost.flops
        self.hbm_bytes += cost.bytes_moved
        if duration_s <= 0:
            return
        roofline_s = max(cost.bytes_moved / self.gpu.hbm_bytes_per_s,
                         cost.flops / self.gpu.bf16_flops_per_s)
        utilisation = min(roofline_s / duration_s, 1.0)
        active_w = (self.gpu.max_power_w - self.gpu.idle_power_w) * utilisation
        self._active_j += active_w * duration_s
        self._last_power_w = self.gpu.idle_power_w + active_w

    def power_w(self) -> float:
        """Now: the board's reading, or the modelled power of the latest step."""
        if self._measured is not None:
            return self._measured.power_w()
        return self._last_power_w

    def energy_j(self) -> float:
        """Since this meter started: measured, or idle power over the wall time plus each
        step's modelled power above idle."""
        if self._measured is not None:
            return self._measured.energy_j() - self._energy_at_start_j
        return self.gpu.idle_power_w * (self._clock() - self._started_s) + self._active_j
