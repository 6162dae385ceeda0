"""The GPU table: the three numbers a serving roofline needs for each accelerator.

Peak numbers are NVIDIA's datasheet values; the memory size is what the driver reports as the
device total (``nvidia-smi``'s ``MiB`` total, i.e. what ``cudaMemGetInfo`` hands an engine to
split between weights, activations and the KV cache).

Sources:

* A100 SXM4 80GB — NVIDIA A100 Tensor Core GPU datasheet (2021): HBM2e bandwidth 2,039 GB/s,
  BF16 Tensor Core 312 TFLOPS dense (624 with structured sparsity), 80 GB HBM2e;
  ``nvidia-smi`` reports 81,920 MiB.
* H100 SXM5 80GB — NVIDIA H100 Tensor Core GPU datasheet (2023): HBM3 bandwidth 3.35 TB/s,
  BF16 Tensor Core 1,979 TFLOPS *with sparsity*, i.e. 989.4 TFLOPS dense, 80 GB HBM3;
  ``nvidia-smi`` reports 81,559 MiB.
* H200 SXM 141GB — NVIDIA H200 Tensor Core GPU datasheet (2024): HBM3e bandwidth 4.8 TB/s,
  BF16 Tensor Core 1,979 TFLOPS with sparsity (989.4 dense, same Hopper die as H100), 141 GB
  HBM3e; ``nvidia-smi`` reports 143,771 MiB.

Power (``max_power_w``, ``idle_power_w``), for the modelled power of the sim and CPU backends
(``engine.gpu_meter``): the maximum is each datasheet's "Max thermal design power" for the SXM
part (A100 400 W, H100 700 W, H200 up to 700 W). NVIDIA publishes no idle figure; the idle
numbers (A100 60 W, H100 and H200 70 W) are an assumption of this table, the order of what
``nvidia-smi`` shows for an idle SXM board with its memory clocks up. Modelled power is labelled
``source="modelled"`` wherever it is exported.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUSpec", "gpu_names", "get_gpu", "GPUS"]

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peak HBM bandwidth, dense bf16 peak, and device memory."""

    name: str
    description: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense (no structured sparsity)
    memory_bytes: int
    max_power_w: float = 700.0  # board power limit (datasheet TDP)
    idle_power_w: float = 70.0  # an assumption: see the module docstring

    def __post_init__(self) -> None:
        if self.hbm_bytes_per_s <= 0 or self.bf16_flops_per_s <= 0:
            raise ValueError(f"{self.name}: bandwidth and peak FLOP/s must be > 0")
        if self.memory_bytes <= 0:
            raise ValueError(f"{self.name}: memory_bytes must be > 0")
        if not 0 <= self.idle_power_w <= self.max_power_w:
            raise ValueError(f"{self.name}: need 0 <= idle_power_w <= max_power_w")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the roofline turns from memory- to compute-bound."""
        return self.bf16_flops_per_s / self.hbm_bytes_per_s


GPUS: tuple[GPUSpec, ...] = (
    GPUSpec(
        name="a100-80g",
        description="NVIDIA A100-SXM4-80GB (HBM2e)",
        hbm_bytes_per_s=2.039e12,
        bf16_flops_per_s=312e12,
        memory_bytes=81_920 * _MIB,
        max_power_w=400.0,
        idle_power_w=60.0,
    ),
    GPUSpec(
        name="h100-80g",
        description="NVIDIA H100-SXM5-80GB (HBM3)",
        hbm_bytes_per_s=3.35e12,
        bf16_flops_per_s=989.4e12,
        memory_bytes=81_559 * _MIB,
        max_power_w=700.0,
        idle_power_w=70.0,
    ),
    GPUSpec(
        name="h200",
        description="NVIDIA H200-SXM-141GB (HBM3e)",
        hbm_bytes_per_s=4.8e12,
        bf16_flops_per_s=989.4e12,
        memory_bytes=143_771 * _MIB,
        max_power_w=700.0,
        idle_power_w=70.0,
    ),
)


def gpu_names() -> tuple[str, ...]:
    return tuple(g.name for g in GPUS)


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by its table key (case-insensitive); ValueError lists the valid keys."""
    key = name.strip().lower()
    for gpu in GPUS:
        if gpu.name == key:
            return gpu
    raise ValueError(f"unknown GPU {name!r}; valid names: {', '.join(gpu_names())}")
