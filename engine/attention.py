"""Paged attention in plain torch.

Every scheduled token is one row of a flat batch [T]. Each layer writes the new
keys/values into the paged cache through `slot_mapping`, then attends, per
group of sequences, over keys gathered from the cache through block tables.
Decodes (one query each) and prefill chunks form separate groups so a long
prompt does not pad every decode to its length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (pads point at row 0)
    out_index: torch.Tensor  # [B, Q] where results go (pads go to the dummy row T)
    kv_slots: torch.Tensor  # [B, K] cache slots of each sequence's context (pads: 0)
    mask: torch.Tensor  # [B, 1, Q, K] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
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
) -> torch.Tensor:
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(meta.num_tokens + 1, q.shape[1], q.shape[2])
    for g in meta.groups:
        qg = q[g.q_index].transpose(1, 2)  # [B, H, Q, D]
        kg = k_cache[g.kv_slots].transpose(1, 2)  # [B, Hkv, K, D]
        vg = v_cache[g.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
        out[g.out_index] = o.transpose(1, 2)  # [B, Q, H, D]
    return out[: meta.num_tokens]
