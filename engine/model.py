"""Llama-architecture decoder over a flat batch of tokens (all sequences of a step at once).

Weights arrive as an HF-Llama state dict; q/k/v and gate/up projections are fused at load so
each layer runs four matmuls. Attention is injected per call, so the same weights serve the
paged runner and any other attention scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config import ModelConfig

__all__ = ["LayerWeights", "LlamaModel", "random_state_dict", "rope_cos_sin"]

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights, ``[out, in]`` as in HF. ``*_t`` are their transposed views (no
    copies): the forward multiplies ``x @ w_t`` with ``torch.mm``, one dispatch per projection
    instead of ``linear``'s two."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor
    qkv_t: torch.Tensor = field(init=False, repr=False, compare=False)
    o_t: torch.Tensor = field(init=False, repr=False, compare=False)
    gate_up_t: torch.Tensor = field(init=False, repr=False, compare=False)
    down_t: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            object.__setattr__(self, name + "_t", getattr(self, name).t())


def random_state_dict(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random HF-Llama weights: embeddings ~ N(0, 1), each projection ~ N(0, 1/fan_in)
    so every layer's contribution is unit-scale and the output depends on the whole context;
    norm weights 1."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype).mul_(std)

    def proj(rows: int, cols: int) -> torch.Tensor:
        return normal(rows, cols, cols ** -0.5)

    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    sd = {"model.embed_tokens.weight": normal(config.vocab_size, h, 1.0)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        sd[p + "self_attn.q_proj.weight"] = proj(config.num_heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = proj(config.num_kv_heads * d, h)
        sd[p + "self_attn.v_proj.weight"] = proj(config.num_kv_heads * d, h)
        sd[p + "self_attn.o_proj.weight"] = proj(h, config.num_heads * d)
        sd[p + "mlp.gate_proj.weight"] = proj(i, h)
        sd[p + "mlp.up_proj.weight"] = proj(i, h)
        sd[p + "mlp.down_proj.weight"] = proj(h, i)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
    sd["model.norm.weight"] = torch.ones(h, dtype=dtype, device=device)
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = proj(config.vocab_size, h)
    return sd


def rope_cos_sin(config: ModelConfig, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (HF/NeoX) tables, each [max_len, head_dim], computed in float64."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / config.head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm, op for op (statistics in float32)."""
    if x.dtype == torch.float32:  # the same ops without two no-op conversions
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    """Inference-only Llama; ``forward`` takes flat token ids and positions of a whole step."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"state dict lacks {name}")
            return state_dict[name].to(self.device, dtype)

        self.embed = w("model.embed_tokens.weight")
        self.layers = [self._load_layer(w, n) for n in range(config.num_layers)]
        self.norm = w("model.norm.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in state_dict else self.embed
        self.cos, self.sin = rope_cos_sin(config, config.max_model_len, self.device, dtype)
        self._check_shapes()

    @staticmethod
    def _load_layer(w: Callable[[str], torch.Tensor], n: int) -> LayerWeights:
        p = f"model.layers.{n}."
        qkv = torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)
        gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)
        return LayerWeights(attn_norm=w(p + "input_layernorm.weight"), qkv=qkv,
                            o=w(p + "self_attn.o_proj.weight"),
                            mlp_norm=w(p + "post_attention_layernorm.weight"), gate_up=gate_up,
                            down=w(p + "mlp.down_proj.weight"))

    def _check_shapes(self) -> None:
        c = self.config
        expect = {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size),
                  "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
                  "gate_up": (2 * c.intermediate_size, c.hidden_size)}
        actual = {"embed": self.embed.shape, "lm_head": self.lm_head.shape,
                  "qkv": self.layers[0].qkv.shape, "gate_up": self.layers[0].gate_up.shape}
        for name, shape in expect.items():
            if tuple(actual[name]) != shape:
                raise ValueError(f"{name} has shape {tuple(actual[name])}, config wants {shape}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights back under HF names (views of the fused tensors, no copies)."""
        c = self.config
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sd = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."
            q, k, v = layer.qkv.split([q_rows, kv_rows, kv_rows], dim=0)
            gate, up = layer.gate_up.split(c.intermediate_size, dim=0)
            sd |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.down,
                   p + "input_layernorm.weight": layer.attn_norm,
                   p + "post_attention_layernorm.weight": layer.mlp_norm}
        if self.lm_head is not self.embed:
            sd["lm_head.weight"] = self.lm_head
        return sd

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for flat ``token_ids`` [T]."""
        c = self.config
        x = F.embedding(token_ids, self.embed)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        num_heads, num_kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        qk_size, q_size = (num_heads + num_kv_heads) * head_dim, num_heads * head_dim
        eps = c.rms_norm_eps
        for n, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, eps)
            qkv = torch.mm(h, layer.qkv_t)
            # Q and K heads side by side: one rotary pass for both (the same elementwise ops)
            qk = _apply_rope(qkv[:, :qk_size].view(-1, num_heads + num_kv_heads, head_dim),
                             cos, sin)
            v = qkv[:, qk_size:].view(-1, num_kv_heads, head_dim)
            attn = attention(n, qk[:, :num_heads], qk[:, num_heads:], v).reshape(-1, q_size)
            x = x + torch.mm(attn, layer.o_t)
            h = _rms_norm(x, layer.mlp_norm, eps)
            gate, up = torch.mm(h, layer.gate_up_t).chunk(2, dim=-1)
            x = x + torch.mm(F.silu(gate) * up, layer.down_t)
        return _rms_norm(x, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.mm(hidden, self.lm_head.t()).float()
