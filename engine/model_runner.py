"""The torch runner: owns the weights and the paged KV tensors, executes one step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, build_metadata, paged_attention
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.scheduler_output import SchedulerOutput

__all__ = ["ModelRunner"]

# On CPU, attention runs over groups of sequences whose gathered K+V (one layer) fit in about
# this many bytes, so the gathered copy is still in cache when attention reads it.
_CPU_GATHER_GROUP_BYTES = 2 << 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Builds the step's tensors, runs one batched forward over every scheduled token, samples.

    ``attention_fn`` has the signature of ``engine.attention.paged_attention``.
    ``gather_group_bytes``: see ``engine.attention.AttentionMetadata.groups`` (default: 2 MiB
    on CPU, one group on GPUs).
    """

    backend = "torch"
    timing_model = None
    time_scale = 1.0

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0,
                 attention_fn: Callable[..., torch.Tensor] = paged_attention,
                 gather_group_bytes: int | None = None) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        self.attention_fn = attention_fn
        self.scale = 1.0 / math.sqrt(c.head_dim)
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self._layer_caches = [(layer[0], layer[1]) for layer in self.kv_cache]  # views
        self.sampler = Sampler(model.device, seed)
        if gather_group_bytes is None and model.device.type == "cpu":
            gather_group_bytes = _CPU_GATHER_GROUP_BYTES
        bytes_per_token = 2 * c.num_kv_heads * c.head_dim * self.kv_cache.element_size()
        self.max_group_tokens = (None if gather_group_bytes is None
                                 else max(gather_group_bytes // bytes_per_token, 1))

    @staticmethod
    def torch_dtype(name: str) -> torch.dtype:
        return _DTYPES[name]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        self.sampler.release(scheduler_output.finished_request_ids)
        entries = scheduler_output.scheduled
        if not entries:
            return {}
        device = self.model.device
        meta = build_metadata(
            query_lens=[e.num_new_tokens for e in entries],
            context_lens=[e.num_computed_tokens + e.num_new_tokens for e in entries],
            block_tables=[e.block_ids for e in entries], block_size=self.block_size,
            device=device, max_group_tokens=self.max_group_tokens)
        token_ids = [t for e in entries for t in e.token_ids]
        positions = [p for e in entries
                     for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens)]
        hidden = self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64).to(device),
            torch.tensor(positions, dtype=torch.int64).to(device),
            self._attention(meta))
        return self._sample(entries, hidden)

    def _attention(self, meta: AttentionMetadata):
        caches, attention_fn, scale = self._layer_caches, self.attention_fn, self.scale

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = caches[layer]
            return attention_fn(q, k, v, k_cache, v_cache, meta, scale)
        return attend

    def _sample(self, entries, hidden: torch.Tensor) -> dict[str, int]:
        last_index, rows = 0, []
        for e in entries:
            last_index += e.num_new_tokens
            if e.samples:
                rows.append((last_index - 1, e))
        if not rows:
            return {}
        index = torch.tensor([i for i, _ in rows], dtype=torch.int64).to(hidden.device)
        logits = self.model.logits(hidden.index_select(0, index))
        tokens = self.sampler.sample(logits, [e.request_id for _, e in rows],
                                     [e.params for _, e in rows])
        return {e.request_id: tok for (_, e), tok in zip(rows, tokens, strict=True)}
