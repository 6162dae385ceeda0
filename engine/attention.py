"""Attention over the paged KV cache: the one function to replace with a fused kernel.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V.
Token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionMetadata", "build_metadata", "paged_attention"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (all on the model's device).

    Tokens of the step are flat (sequence after sequence). ``groups`` splits the sequences
    into runs whose gathered K/V stay cache-sized (CPU); attention runs group by group. ``query_index`` places each flat
    token in a padded ``[num_seqs * max_query_len]`` grid (None when every sequence has one
    query token). ``attn_mask`` [num_seqs, 1, max_query_len, max_context_len] is True where a
    query may attend to a key (causal, within the sequence's context).
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with block 0)
    attn_mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool
    query_index: torch.Tensor | None  # [T] int64, or None when Qmax == 1
    num_seqs: int
    max_query_len: int
    max_context_len: int
    groups: tuple[tuple[int, int, int], ...] = ()  # (first seq, end seq, max context len)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device,
                   max_group_tokens: int | None = None) -> AttentionMetadata:
    """``context_lens[b]`` = tokens cached for sequence b after this step (computed + new).
    ``max_group_tokens`` bounds (sequences x padded context) per attention group."""
    num_seqs = len(query_lens)
    q_max, l_max = max(query_lens), max(context_lens)
    num_blocks = -(-l_max // block_size)
    tables = torch.zeros(num_seqs, num_blocks, dtype=torch.int64)
    for b, table in enumerate(block_tables):
        used = table[: -(-context_lens[b] // block_size)]
        tables[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    first_token = torch.cumsum(q_lens, 0) - q_lens
    offset = torch.arange(int(q_lens.sum())) - first_token[seq_of_token]
    positions = (ctx_lens - q_lens)[seq_of_token] + offset
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    query_pos = (ctx_lens - q_lens).view(-1, 1) + torch.arange(q_max).view(1, -1)  # [B, Qmax]
    key_pos = torch.arange(l_max).view(1, 1, -1)
    mask = (key_pos <= query_pos.unsqueeze(-1)) & (key_pos < ctx_lens.view(-1, 1, 1))
    query_index = None if q_max == 1 else seq_of_token * q_max + offset
    return AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        attn_mask=mask.unsqueeze(1).to(device),
        query_index=None if query_index is None else query_index.to(device),
        num_seqs=num_seqs, max_query_len=q_max, max_context_len=l_max,
        groups=_groups(context_lens, max_group_tokens))


def _groups(context_lens: list[int], max_group_tokens: int | None) -> tuple[tuple[int, int, int], ...]:
    if max_group_tokens is None:
        return ((0, len(context_lens), max(context_lens)),)
    groups, start, longest = [], 0, 0
    for b, length in enumerate(context_lens):
        wider = max(longest, length)
        if b > start and wider * (b + 1 - start) > max_group_tokens:
            groups.append((start, b, longest))
            start, wider = b, length
        longest = wider
    groups.append((start, len(context_lens), longest))
    return tuple(groups)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Write the step's K/V into their slots, then attend each query token over its sequence.

    query [T, Hq, D], key/value [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
    Returns [T, Hq, D].
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
    b, q_max = meta.num_seqs, meta.max_query_len
    num_heads = query.shape[1]
    if meta.query_index is None:
        q = query.view(b, 1, num_heads, head_dim)
    else:
        q = query.new_zeros(b * q_max, num_heads, head_dim)
        q.index_copy_(0, meta.query_index, query)
        q = q.view(b, q_max, num_heads, head_dim)
    q = q.transpose(1, 2)  # [B, Hq, Qmax, D]
    if len(meta.groups) == 1:
        out = _attend(q, k_cache, v_cache, meta.block_tables, meta.attn_mask, meta.max_context_len,
                      scale)
    else:
        out = torch.empty_like(q)
        for start, end, l_max in meta.groups:
            out[start:end] = _attend(q[start:end], k_cache, v_cache,
                                     meta.block_tables[start:end], meta.attn_mask[start:end],
                                     l_max, scale)
    out = out.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)
    return out if meta.query_index is None else out.index_select(0, meta.query_index)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, attn_mask: torch.Tensor, l_max: int,
            scale: float) -> torch.Tensor:
    """Causal attention of q [B, Hq, Qmax, D] over the first ``l_max`` cached positions."""
    num_blocks = -(-l_max // k_cache.shape[1])
    keys = _gather(k_cache, block_tables[:, :num_blocks], l_max)
    values = _gather(v_cache, block_tables[:, :num_blocks], l_max)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=attn_mask[..., :l_max], scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1])


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, l_max: int) -> torch.Tensor:
    """[B, Hkv, l_max, D] keys (or values) of each sequence, in position order."""
    b, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))
    gathered = gathered.view(b, num_blocks * block_size, num_kv_heads, head_dim)[:, :l_max]
    return gathered.transpose(1, 2)
