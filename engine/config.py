"""Engine configuration: model shape presets, KV cache, scheduler, and the whole engine."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "PRESET_NAMES",
    "SchedulerConfig",
    "model_preset",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU).

    ``weights`` says where parameters come from: ``"random"`` (seeded normal init) or
    ``"smollm2-gguf"`` (``engine.gguf_loader.load_smollm2``).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    weights: str = "random"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.weights not in ("random", "smollm2-gguf"):
            raise ValueError(f"unknown weights source {self.weights!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V for all layers, one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[dtype]

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size + head + self.hidden_size


def _presets() -> dict[str, ModelConfig]:
    llama = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                 intermediate_size=14336)
    return {
        "tiny": ModelConfig(name="tiny", vocab_size=49152, hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                            max_model_len=1024),
        "smollm2-135m": ModelConfig(name="smollm2-135m", vocab_size=49152, hidden_size=576,
                                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                    intermediate_size=1536, max_model_len=8192,
                                    rope_theta=100000.0, tie_word_embeddings=True,
                                    eos_token_ids=(2,), weights="smollm2-gguf"),
        "llama-7b": ModelConfig(name="llama-7b", vocab_size=32000, max_model_len=4096,
                                eos_token_ids=(2,), **llama),
        "llama-3.1-8b": ModelConfig(name="llama-3.1-8b", vocab_size=128256, max_model_len=8192,
                                    rope_theta=500000.0, eos_token_ids=(128001,), **llama),
    }


PRESET_NAMES: tuple[str, ...] = tuple(_presets())


def model_preset(name: str) -> ModelConfig:
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(presets)}")
    return presets[name]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Pool size from ``num_blocks`` if given, else from ``kv_cache_bytes``,
    else the engine picks: enough for ``max_num_seqs`` full-length sequences, capped at 1 GiB
    (on CUDA: capped at 90 % of free GPU memory less the weights). ``enable_prefix_caching``:
    full blocks stay reusable by later requests with the same prefix (engine.block_manager)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be a bool, got "
                             f"{self.enable_prefix_caching!r}")

    def resolve_num_blocks(self, bytes_per_block: int, default_num_blocks: int,
                           default_budget_bytes: int = 1 << 30) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_bytes if self.kv_cache_bytes is not None else default_budget_bytes
        by_budget = budget // bytes_per_block
        if by_budget < 1:
            raise ValueError(f"kv_cache_bytes={budget} holds no {bytes_per_block}-byte block")
        return by_budget if self.kv_cache_bytes is not None else min(by_budget, default_num_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits. ``policy``: "fcfs" or "priority" (lower value first)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine. ``device``/``dtype`` None: CUDA + bfloat16 when available, else
    CPU + float32. The context limit is ``model.max_model_len`` (override it by name)."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    num_iteration_records: int = 64
    check_invariants: bool = False  # full scheduler/block checks after every step (tests)

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.num_iteration_records < 1:
            raise ValueError("num_iteration_records must be >= 1")
        if (not self.scheduler.enable_chunked_prefill
                and self.scheduler.max_num_batched_tokens < self.max_model_len):
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             f"max_model_len ({self.max_model_len})")

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def num_kv_blocks(self, default_budget_bytes: int = 1 << 30) -> int:
        bytes_per_block = self.cache.block_size * self.model.kv_bytes_per_token(self.resolved_dtype())
        blocks_per_seq = math.ceil(self.max_model_len / self.cache.block_size)
        return self.cache.resolve_num_blocks(
            bytes_per_block, blocks_per_seq * self.scheduler.max_num_seqs, default_budget_bytes)

    @property
    def weight_bytes(self) -> int:
        return self.model.num_params * _DTYPE_BYTES[self.resolved_dtype()]

    @classmethod
    def from_preset(cls, name: str, **overrides) -> EngineConfig:
        """Build from a preset name; overrides may name any field of EngineConfig,
        CacheConfig, SchedulerConfig or ModelConfig (e.g. ``num_blocks=64``)."""
        return cls.from_model(model_preset(name), **overrides)

    @classmethod
    def from_model(cls, model: ModelConfig, **overrides) -> EngineConfig:
        parts: dict[str, dict] = {"model": {}, "cache": {}, "scheduler": {}, "engine": {}}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        engine_fields = {f.name for f in dataclasses.fields(cls)} - set(owners)
        for key, value in overrides.items():
            owner = next((o for o, t in owners.items()
                          if key in {f.name for f in dataclasses.fields(t)}), None)
            if owner is None and key not in engine_fields:
                raise ValueError(f"unknown engine option {key!r}")
            parts[owner or "engine"][key] = value
        return cls(model=dataclasses.replace(model, **parts["model"]),
                   cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]), **parts["engine"])
