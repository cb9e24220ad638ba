"""Paged attention in plain torch.

Every scheduled token is one row of a flat batch [T]. Each layer writes the new
keys/values into the paged cache through `slot_mapping` (rope_and_store), then attends, per
group of sequences, over keys gathered from the cache through block tables.
Decodes (one query each) and prefill chunks form separate groups so a long
prompt does not pad every decode to its length. A group carries, per attention
window the model uses (None: full causal attention), the cache slots its keys
come from and its mask: a model whose sliding-window layers keep their KV in a
pool of their own gathers those layers' keys from that pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from sluice.engine.rope import Rotary


@dataclass
class AttentionGroup:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (pads point at row 0)
    out_index: torch.Tensor  # [B, Q] where results go (pads go to the dummy row T)
    kv_slots: dict[int | None, torch.Tensor]  # window -> [B, K] cache slots of each sequence's keys (pads: 0)
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, Q, K] bool, True = attend
    # window -> key k of each sequence is at position k and each query attends the keys at positions 0..its
    # own (no window cuts them): a causal kernel needs only where each sequence's queries begin
    by_position: dict[int | None, bool] = field(default_factory=dict)
    q_starts: torch.Tensor | None = None  # [B] int64 on the host, each sequence's first query position
    # window -> that, and every sequence's queries from its first token: plain causal from position 0, where
    # SDPA's is_causal skips the masked blocks (derived at construction)
    causal: dict[int | None, bool] = field(init=False)

    def __post_init__(self) -> None:
        from_zero = self.q_starts is None or not bool(self.q_starts.any())
        self.causal = {w: ok and from_zero for w, ok in self.by_position.items()}


@dataclass
class AttentionMetadata:
    slot_mapping: dict[int | None, torch.Tensor]  # window -> [T] cache slot of each new token
    groups: list[AttentionGroup]
    num_tokens: int
    # The whole step as one group of one query per row, each over its own sequence's keys (a decode step's
    # one group; for a step with prefill chunks, when [T, K] is small): what a step in one kernel call reads.
    row_group: AttentionGroup | None = None


def rope_and_store(qk: torch.Tensor, v: torch.Tensor, heads: int, rotary: Rotary, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotary on a step's queries and keys qk [T, H + Hkv, D] (queries first), the rotated keys and the
    values v [T, Hkv, D] written into the paged cache at `slots` [T] (in the cache's dtype, which may be
    narrower than the activations': --kv-cache-dtype); returns the rotated queries [T, H, D]."""
    q, k = rotary(qk, positions).split([heads, qk.shape[1] - heads], dim=1)
    store_rows(k_cache, slots, k)
    store_rows(v_cache, slots, v)
    return q


# An int8 cache's (slot, kv head) row: its head dim's codes, then their scale, a float32's 4 bytes
INT8_SCALE_BYTES = 4


def cache_row(dtype: torch.dtype, dim: int) -> int:
    """The elements of a cache's (slot, kv head) row for a head dim: the dim, and an int8 cache's scale."""
    return dim + INT8_SCALE_BYTES if dtype == torch.int8 else dim


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [T, Hkv, D] written into the cache at `slots` (its first dimension) in the cache's dtype, as
    csrc/f32_vec.h's kv_put writes them. An fp8 cache (vLLM's `fp8`, no scale) saturates at its largest finite
    value and is written as bytes (torch's index_copy_ takes no float8). An int8 cache holds each row of D
    values as D codes round(x / s) (to nearest even) and s = max |x| / 127 after them (codes 0 and s 0 for a
    row of zeros)."""
    if cache.dtype == torch.int8:
        rows = rows.float()
        scale = rows.abs().amax(-1, keepdim=True) / 127
        codes = torch.where(scale > 0, rows / scale, 0.0).round_().to(torch.int8)
        cache.index_copy_(0, slots, torch.cat([codes, scale.view(torch.int8)], dim=-1))
    elif cache.dtype.is_floating_point and cache.element_size() == 1:
        top = torch.finfo(cache.dtype).max
        cache.view(torch.uint8).index_copy_(0, slots, rows.clamp(-top, top).to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


def widened(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows [..., D] (an int8 cache's [..., D + 4]) as values of `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scale = rows.split([rows.shape[-1] - INT8_SCALE_BYTES, INT8_SCALE_BYTES], dim=-1)
    return (codes.float() * scale.contiguous().view(torch.float32)).to(dtype)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D], holding this step's keys (rope_and_store)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H] learned logits of a "sink" key (gpt-oss)
    decode: Callable[..., bool] | None = None,  # a backend's kernel for groups of one query each (see Backend)
    causal: Callable[..., bool] | None = None,  # a backend's kernel for prompts and their chunks (Backend)
    softcap: float | None = None,  # scores soft-capped as softcap * tanh(s / softcap) (Gemma 2): torch only
) -> torch.Tensor:
    out = q.new_empty(meta.num_tokens + 1, q.shape[1], q.shape[2])
    if softcap is not None:  # (neither the backends' kernels nor SDPA cap the scores)
        decode = causal = None
    for g in meta.groups:
        if decode is not None and g.q_index.shape[1] == 1 and decode(
                q, k_cache, v_cache, g.q_index.view(-1), g.kv_slots[window], g.masks[window], scale, sinks, out):
            continue  # decodes, read where they lie in the cache
        if causal is not None and sinks is None and g.by_position.get(window) and causal(
                q, k_cache, v_cache, g.q_index, g.kv_slots[window], g.out_index, scale, g.q_starts, out):
            continue  # prompts, read where they lie
        qr, kr, vr = (widened(_rows(x, i), q.dtype) for x, i in ((q, g.q_index), (k_cache, g.kv_slots[window]),
                                                                  (v_cache, g.kv_slots[window])))  # [B, Q|K, H|Hkv, D]
        qg, kg, vg = qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2)  # [B, H or Hkv, Q or K, D]
        mask = g.masks[window]
        # Batched decodes on the CPU: torch's SDPA there is 2-4x slower than a few matmuls for one query each.
        cpu_decodes = q.device.type == "cpu" and qg.shape[2] == 1 and qg.shape[0] > 1
        sdpa = sinks is None and softcap is None and not cpu_decodes
        if sdpa and g.causal.get(window):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
        elif sdpa:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = _attention(qg, kg, vg, mask, scale, sinks, softcap)
        out[g.out_index] = o.transpose(1, 2)  # [B, Q, H, D]
    return out[: meta.num_tokens]


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for an index [B, N] into x's first dimension: [B, N, ...] (index_select: ~3x faster on the
    CPU than advanced indexing)."""
    return x.index_select(0, index.view(-1)).view(*index.shape, *x.shape[1:])


def _attention(q, k, v, mask, scale, sinks=None, softcap=None):
    """softmax(q k^T scale) v in float32 for q [B, H, Q, D], k and v [B, Hkv, K, D], mask [B, 1, Q, K]
    (grouped-query: each k/v head serves H/Hkv query heads, without repeating it). `sinks` [H]: a per-head
    extra logit whose share of the attention goes nowhere (gpt-oss). `softcap`: the scores s soft-capped as
    softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scores = (q.reshape(b, hkv, g * nq, d).float() @ k.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*Q, K]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(b, hkv, g, nq, -1).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = probs.reshape(b, hkv, g * nq, -1) @ v.float()  # [B, Hkv, G*Q, D]
    return out.view(b, h, nq, d).to(q.dtype)
