"""Attention over the paged KV cache: the one function to replace with a fused kernel.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V.
Token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block * block_size + offset``.

The step's sequences are cut into groups of consecutive sequences with the same number of
new tokens (all the decodes together; each prefill chunk alone unless chunks match), so
queries never need padding. Each group gathers its sequences' K/V from their block tables
(one vectorised ``index_select``) and runs ``scaled_dot_product_attention`` once. A group of
one sequence whose blocks are consecutive ids (the common case at batch 1: the free list hands
blocks out in order) reads its K/V as a view of the cache instead: the same tensor, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionGroup", "AttentionMetadata", "build_metadata", "paged_attention"]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences ``[seq_start, seq_end)`` each with ``query_len`` new tokens, which are the
    flat tokens ``[token_start, token_start + num_seqs * query_len)``.

    ``attn_mask`` [num_seqs, 1, query_len, max_context_len] (True = may attend) or None when
    every query sees every key; ``is_causal`` marks one sequence with no cached prefix.
    ``first_block``: for one sequence whose used blocks are consecutive ids, the first of them
    (its K/V are read as a view of the cache), else None.
    """

    seq_start: int
    seq_end: int
    token_start: int
    query_len: int
    max_context_len: int
    attn_mask: torch.Tensor | None
    is_causal: bool
    first_block: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_end - self.seq_start

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_seqs * self.query_len


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with block 0)
    groups: tuple[AttentionGroup, ...]


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device,
                   max_group_tokens: int | None = None) -> AttentionMetadata:
    """``context_lens[b]``: tokens cached for sequence b after this step (computed + new).
    ``max_group_tokens`` bounds (sequences x longest context) per group: on a CPU this keeps
    the gathered K/V cache-resident until attention reads them."""
    num_blocks = -(-max(context_lens) // block_size)
    tables = torch.zeros(len(query_lens), num_blocks, dtype=torch.int64)
    for b, table in enumerate(block_tables):
        used = table[: -(-context_lens[b] // block_size)]
        tables[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    offset = torch.arange(int(q_lens.sum())) - (torch.cumsum(q_lens, 0) - q_lens)[seq_of_token]
    positions = (ctx_lens - q_lens)[seq_of_token] + offset
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    groups = tuple(_group(start, end, query_lens, context_lens, device,
                          _first_block(start, end, block_tables, context_lens, block_size))
                   for start, end in _split(query_lens, context_lens, max_group_tokens))
    return AttentionMetadata(slot_mapping=slots.to(device), block_tables=tables.to(device),
                             groups=groups)


def _split(query_lens: list[int], context_lens: list[int],
           max_group_tokens: int | None) -> list[tuple[int, int]]:
    """Runs of consecutive sequences with equal query length, capped by max_group_tokens."""
    bounds, start, longest = [], 0, context_lens[0]
    for b in range(1, len(query_lens)):
        wider = max(longest, context_lens[b])
        too_big = max_group_tokens is not None and wider * (b + 1 - start) > max_group_tokens
        if query_lens[b] != query_lens[start] or too_big:
            bounds.append((start, b))
            start, wider = b, context_lens[b]
        longest = wider
    bounds.append((start, len(query_lens)))
    return bounds


def _first_block(start: int, end: int, block_tables: list[list[int]], context_lens: list[int],
                 block_size: int) -> int | None:
    """The first block of a one-sequence group whose used blocks are consecutive ids."""
    if end - start != 1:
        return None
    used = block_tables[start][: -(-context_lens[start] // block_size)]  # a list or a tuple
    first = used[0]
    consecutive = used[-1] - first == len(used) - 1 and all(
        block == first + i for i, block in enumerate(used))
    return first if consecutive else None


def _group(start: int, end: int, query_lens: list[int], context_lens: list[int],
           device: torch.device, first_block: int | None = None) -> AttentionGroup:
    q_len, ctx = query_lens[start], context_lens[start:end]
    l_max = max(ctx)
    is_causal = end - start == 1 and q_len > 1 and ctx[0] == q_len
    mask = None
    if not is_causal and not (q_len == 1 and min(ctx) == l_max):
        ctx_t = torch.tensor(ctx, dtype=torch.int64).view(-1, 1, 1)
        query_pos = ctx_t - q_len + torch.arange(q_len).view(1, -1, 1)
        key_pos = torch.arange(l_max).view(1, 1, -1)
        mask = ((key_pos <= query_pos) & (key_pos < ctx_t)).unsqueeze(1).to(device)
    token_start = sum(query_lens[:start])
    return AttentionGroup(seq_start=start, seq_end=end, token_start=token_start, query_len=q_len,
                          max_context_len=l_max, attn_mask=mask, is_causal=is_causal,
                          first_block=first_block)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Write the step's K/V into their slots, then attend each query token over its sequence.

    query [T, Hq, D], key/value [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
    Returns [T, Hq, D].
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
    if len(meta.groups) == 1:
        return _attend(query, k_cache, v_cache, meta.block_tables, meta.groups[0], scale)
    out = torch.empty_like(query)
    for group in meta.groups:
        out[group.token_start : group.token_end] = _attend(
            query[group.token_start : group.token_end], k_cache, v_cache,
            meta.block_tables[group.seq_start : group.seq_end], group, scale)
    return out


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    """One group: query [n * q, Hq, D] → [n * q, Hq, D]."""
    num_heads, head_dim = query.shape[1:]
    q = query.view(group.num_seqs, group.query_len, num_heads, head_dim).transpose(1, 2)
    num_blocks = -(-group.max_context_len // k_cache.shape[1])
    if group.first_block is not None:
        blocks = slice(group.first_block, group.first_block + num_blocks)
        keys = _flatten(k_cache[blocks], 1, group.max_context_len)
        values = _flatten(v_cache[blocks], 1, group.max_context_len)
    else:
        keys = _gather(k_cache, block_tables[:, :num_blocks], group.max_context_len)
        values = _gather(v_cache, block_tables[:, :num_blocks], group.max_context_len)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=group.attn_mask, is_causal=group.is_causal, scale=scale,
        enable_gqa=num_heads != keys.shape[1])
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, l_max: int) -> torch.Tensor:
    """[B, Hkv, l_max, D] keys (or values) of each sequence, in position order."""
    return _flatten(cache.index_select(0, block_tables.reshape(-1)), block_tables.shape[0], l_max)


def _flatten(blocks: torch.Tensor, b: int, l_max: int) -> torch.Tensor:
    """[b * n, block_size, Hkv, D] blocks (n per sequence, in order) → [b, Hkv, l_max, D]."""
    _, block_size, num_kv_heads, head_dim = blocks.shape
    flat = blocks.view(b, -1, num_kv_heads, head_dim)[:, :l_max]
    return flat.transpose(1, 2)
