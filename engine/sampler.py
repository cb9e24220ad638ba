"""Batched sampling: one pass over [B, V] logits, no per-request loop over the vocabulary.

Sampling is inverse-CDF with one uniform number per row, drawn from a hash of
(request seed, output position): a seeded request gets the same tokens alone,
in any batch, and after a preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_GREEDY_EPS = 1e-5
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform_from(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A uniform float in [0, 1) per row from splitmix64(seed, step)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] long, 0 = off
    min_p: torch.Tensor  # [B]
    uniform: torch.Tensor  # [B] float64
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: list, seeds: list[int], steps: list[int], device: torch.device) -> "SamplingBatch":
        temp = np.array([p.temperature for p in params], dtype=np.float32)
        top_p = np.array([p.top_p for p in params], dtype=np.float32)
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        min_p = np.array([p.min_p for p in params], dtype=np.float32)
        u = uniform_from(np.array(seeds, dtype=np.uint64), np.array(steps, dtype=np.uint64))
        return cls(
            temperature=torch.from_numpy(temp).to(device),
            top_p=torch.from_numpy(top_p).to(device),
            top_k=torch.from_numpy(top_k).to(device),
            min_p=torch.from_numpy(min_p).to(device),
            uniform=torch.from_numpy(u).to(device),
            all_greedy=bool((temp < _GREEDY_EPS).all()),
            any_top_p=bool((top_p < 1.0).any()),
            any_top_k=bool((top_k > 0).any()),
            any_min_p=bool((min_p > 0.0).any()),
        )


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B]."""
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy
    is_greedy = sb.temperature < _GREEDY_EPS
    logits = logits / torch.where(is_greedy, 1.0, sb.temperature).unsqueeze(1)
    if sb.any_top_k:
        logits = _apply_top_k(logits, sb.top_k)
    if sb.any_top_p:
        logits = _apply_top_p(logits, sb.top_p)
    probs = logits.softmax(dim=-1)
    if sb.any_min_p:
        keep = probs >= (sb.min_p * probs.max(dim=-1).values).unsqueeze(1)
        probs = probs * keep
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    target = (sb.uniform * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    return torch.where(is_greedy, greedy, sampled)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k_max = int(top_k.max())
    kth = logits.topk(min(k_max, logits.shape[1]), dim=-1).values  # [B, k_max]
    idx = (top_k.clamp(min=1, max=kth.shape[1]) - 1).unsqueeze(1)
    threshold = kth.gather(1, idx)
    threshold = torch.where(top_k.unsqueeze(1) > 0, threshold, torch.finfo(logits.dtype).min)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = (top_p < 1.0).nonzero().squeeze(1)  # only rows that ask for it pay for the sort
    sub = logits[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop_sorted = before > top_p[rows].unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits = logits.clone()
    logits[rows] = sub.masked_fill(drop, float("-inf"))
    return logits
