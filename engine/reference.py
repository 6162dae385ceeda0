"""Plain reference generation: no KV cache, full recompute of the whole sequence per token.

Written independently of ``engine.model`` (explicit per-sequence attention with a causal
mask, GQA by repeating K/V heads) so that tests comparing the paged engine against it check
the model code as well as the cache, scheduler, and batching.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.config import ModelConfig

__all__ = ["reference_greedy", "reference_logits"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() / torch.sqrt(variance + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, H, D] at positions 0..L-1, rotate-half layout."""
    seq_len, _, dim = x.shape
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] / (theta ** exponents)[None, :]
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [L, Hq, D], k/v [L, Hkv, D] → [L, Hq, D] with a causal mask."""
    seq_len, num_heads, dim = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / dim ** 0.5
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


@torch.inference_mode()
def reference_logits(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                     token_ids: list[int]) -> torch.Tensor:
    """Logits [L, vocab] (float32) for every position of ``token_ids``."""
    sd = state_dict
    c = config
    x = sd["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        h = _rms(x, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(len(token_ids), c.num_heads, c.head_dim)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(len(token_ids), c.num_kv_heads, c.head_dim)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(len(token_ids), c.num_kv_heads, c.head_dim)
        attn = _attention(_rope(q, c.rope_theta), _rope(k, c.rope_theta), v)
        x = x + attn.reshape(len(token_ids), -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _rms(x, sd["model.norm.weight"], c.rms_norm_eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return (x @ head.T).float()


def reference_greedy(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                     prompt_token_ids: list[int], max_tokens: int,
                     stop_token_ids: Iterable[int] = ()) -> list[int]:
    """Greedy continuation, recomputing the full sequence for every new token."""
    stops = set(stop_token_ids)
    tokens = list(prompt_token_ids)
    output: list[int] = []
    for _ in range(max_tokens):
        next_token = int(reference_logits(config, state_dict, tokens)[-1].argmax())
        output.append(next_token)
        tokens.append(next_token)
        if next_token in stops:
            break
    return output
