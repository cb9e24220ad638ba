"""Paged attention in plain torch.

Every scheduled token is one row of a flat batch [T]. Each layer writes the new
keys/values into the paged cache through `slot_mapping`, then attends, per
group of sequences, over keys gathered from the cache through block tables.
Decodes (one query each) and prefill chunks form separate groups so a long
prompt does not pad every decode to its length. A group carries, per attention
window the model uses (None: full causal attention), the cache slots its keys
come from and its mask: a model whose sliding-window layers keep their KV in a
pool of their own gathers those layers' keys from that pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (pads point at row 0)
    out_index: torch.Tensor  # [B, Q] where results go (pads go to the dummy row T)
    kv_slots: dict[int | None, torch.Tensor]  # window -> [B, K] cache slots of each sequence's keys (pads: 0)
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, Q, K] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: dict[int | None, torch.Tensor]  # window -> [T] cache slot of each new token
    groups: list[AttentionGroup]
    num_tokens: int


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H] learned logits of a "sink" key (gpt-oss)
) -> torch.Tensor:
    k_cache.index_copy_(0, meta.slot_mapping[window], k)
    v_cache.index_copy_(0, meta.slot_mapping[window], v)
    out = q.new_empty(meta.num_tokens + 1, q.shape[1], q.shape[2])
    for g in meta.groups:
        qg = _rows(q, g.q_index).transpose(1, 2)  # [B, H, Q, D]
        kg = _rows(k_cache, g.kv_slots[window]).transpose(1, 2)  # [B, Hkv, K, D]
        vg = _rows(v_cache, g.kv_slots[window]).transpose(1, 2)
        mask = g.masks[window]
        if sinks is None:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = _attention_with_sinks(qg, kg, vg, mask, scale, sinks)
        out[g.out_index] = o.transpose(1, 2)  # [B, Q, H, D]
    return out[: meta.num_tokens]


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for an index [B, N] into x's first dimension: [B, N, ...] (index_select: ~3x faster on the
    CPU than advanced indexing)."""
    return x.index_select(0, index.view(-1)).view(*index.shape, *x.shape[1:])


def _attention_with_sinks(q, k, v, mask, scale, sinks):
    """Softmax over the keys and one extra per-head sink logit, whose share of attention goes nowhere."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, H, K, D]
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, Q, K]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v)  # [B, H, Q, D]
