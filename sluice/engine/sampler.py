"""Batched sampling: one pass over [B, V] logits, no per-request loop over the vocabulary.

Order (as vLLM): each request's constraints and penalties (sluice/engine/logit_constraints.py), then
temperature, top-k, top-p, min-p.
Sampling is inverse-CDF with one uniform number per row, drawn from a hash of
(request seed, output position): a seeded request gets the same tokens alone,
in any batch, and after a preemption. Logprobs are those of the model's raw
distribution, before any of the above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from sluice.engine.logit_constraints import GREEDY_EPS, NEG_INF, Constraints, process_logits
from sluice.engine.sequence import Sequence


def uniform_from(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A uniform float in [0, 1) per row from splitmix64(seed, step)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class TokenLogprobs:
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class ExpKernels(NamedTuple):
    """A backend's kernels for the sampler's exp pass (Backend.exp_kernels; the CPU's: csrc/exp_blocks.c)."""

    blocks: Callable  # exp((x - max) / t) over whole rows: each block's sum (and the probs, when asked)
    block: Callable  # the probs of one block a row


@dataclass
class SamplingBatch:
    temperature: torch.Tensor | None  # [B] (None, like the four below, when every row is greedy)
    top_p: torch.Tensor | None  # [B]
    top_k: torch.Tensor | None  # [B] long, 0 = off
    min_p: torch.Tensor | None  # [B]
    uniform: torch.Tensor | None  # [B] float64
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool
    seqs: list[Sequence] | None = None  # for the per-request processors below
    exp: ExpKernels | None = None  # the backend's kernels for the exp pass (None: torch's softmax)

    @classmethod
    def build(cls, params: list, seeds: list[int], steps: list[int], device: torch.device,
              seqs: list[Sequence] | None = None, exp: ExpKernels | None = None) -> "SamplingBatch":
        temp = np.array([p.temperature for p in params], dtype=np.float32)
        if (temp < GREEDY_EPS).all():  # nothing below reads the per-row tensors of an all-greedy batch
            return cls(None, None, None, None, None, all_greedy=True, any_top_p=False, any_top_k=False,
                       any_min_p=False, seqs=seqs, exp=exp)
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
            all_greedy=bool((temp < GREEDY_EPS).all()),
            any_top_p=bool((top_p < 1.0).any()),
            any_top_k=bool((top_k > 0).any()),
            any_min_p=bool((min_p > 0.0).any()),
            seqs=seqs,
            exp=exp,
        )

    @classmethod
    def for_seqs(cls, seqs: list[Sequence], device: torch.device, exp: ExpKernels | None = None,
                 ahead: list[int] | None = None) -> "SamplingBatch":
        """`ahead[r]`: row r samples that many output positions past its sequence's next (a draft's row: the
        uniform of the position it samples, as that position would draw it without a draft)."""
        steps = [s.num_output_tokens for s in seqs]
        if ahead is not None:
            steps = [step + j for step, j in zip(steps, ahead)]
        return cls.build([s.sampling for s in seqs], [s.seed for s in seqs], steps, device, seqs, exp)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] in the model's dtype (values are compared and scaled in float32) -> token ids [B].
    The request's constraints apply first; logits are as they came when it returns (logprobs read them)."""
    if sb.seqs is None:
        return _sample(logits, sb)
    c = Constraints.of(sb.seqs)
    if not c:
        return _sample(logits, sb)
    if not c.masks_only():
        return _sample(process_logits(logits, sb.seqs, c), sb)
    index = torch.tensor(c.rows(), device=logits.device)
    raw = logits[index]  # (a copy of the rows masked, put back after)
    c.apply(logits, sb.seqs)
    try:
        return _sample(logits, sb)
    finally:
        logits[index] = raw


def _sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    if sb.all_greedy:
        return argmax(logits)
    assert sb.temperature is not None  # (set unless all greedy)
    is_greedy = sb.temperature < GREEDY_EPS
    any_greedy = bool(is_greedy.any())
    greedy = argmax(logits) if any_greedy else None
    scale = torch.where(is_greedy, 1.0, sb.temperature).unsqueeze(1)
    # With torch's softmax on the CPU, a few rows at a time: their float32 copy stays in cache through the
    # passes below (at batch 64 the whole batch is 51 MB, past the last-level cache, and the passes run 2x
    # slower). Sluice's kernel makes one pass: the whole batch at once splits best between threads.
    chunked = logits.device.type == "cpu" and sb.exp is None
    step = _CPU_ROWS if chunked else logits.shape[0]
    sampled = torch.cat([_draw(logits[i : i + step], scale[i : i + step], sb, slice(i, i + step))
                         for i in range(0, logits.shape[0], step)])
    return torch.where(is_greedy, greedy, sampled) if any_greedy else sampled


_CPU_ROWS = 8


def _draw(logits: torch.Tensor, scale: torch.Tensor, sb: SamplingBatch, rows: slice) -> torch.Tensor:
    """Samples rows of logits [R, V] scaled by 1/scale [R, 1], with their top-k / top-p / min-p."""
    top_k, top_p, min_p, uniform = sb.top_k, sb.top_p, sb.min_p, sb.uniform
    assert top_k is not None and top_p is not None and min_p is not None and uniform is not None  # (not all greedy)
    some_top_k = sb.any_top_k and bool((top_k[rows] > 0).any())  # these rows, not only others in the batch
    some_top_p = sb.any_top_p and bool((top_p[rows] < 1.0).any())
    if some_top_k or some_top_p:
        logits, scale = _scaled(logits, scale), torch.ones_like(scale)
        if some_top_k:
            logits = _apply_top_k(logits, top_k[rows])
        if some_top_p:
            logits = _apply_top_p(logits, top_p[rows])
    if not sb.any_min_p and (tokens := _draw_from_sums(logits, scale, uniform[rows], sb.exp)) is not None:
        return tokens
    probs, sums = exp_blocks(logits, scale, sb.exp)
    if sb.any_min_p:
        probs.mul_(probs >= min_p[rows].unsqueeze(1) * probs.amax(dim=-1, keepdim=True))
        sums = None
    return inverse_cdf(probs, uniform[rows].to(probs.dtype), sums)


def _draw_from_sums(logits: torch.Tensor, scale: torch.Tensor, u: torch.Tensor,
                    exp: ExpKernels | None) -> torch.Tensor | None:
    """`inverse_cdf(*exp_blocks(logits, scale))`'s tokens (the same bits) from the kernel's block sums
    alone and then the probs of each row's one chosen block: without writing and reading back 4 bytes a
    column. None where the kernel does not apply."""
    done = _exp_pass(logits, scale, exp, write_probs=False)
    if done is None or exp is None:
        return None
    block_kernel = exp.block
    x, sums, row_max, inverse_t = done.logits, done.sums, done.row_max, done.inverse_t
    (r, v), c = x.shape, min(_BLOCK, x.shape[1])

    def block_values(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = block.contiguous()
        values = torch.empty(r, c, dtype=torch.float32)
        block_kernel(x.data_ptr(), x.dtype == torch.bfloat16, r, v, inverse_t.data_ptr(), row_max.data_ptr(),
                     block.data_ptr(), c, values.data_ptr())
        return values, block.unsqueeze(1) * c + torch.arange(c)

    return _pick(u.to(torch.float32), sums, block_values)


def _scaled(logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """logits / scale (a float32 copy), or logits themselves when every scale is 1."""
    return logits if bool((scale == 1.0).all()) else logits / scale


def exp_blocks(logits: torch.Tensor, scale: torch.Tensor,
               exp: ExpKernels | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unnormalized probabilities [R, V] (float32) of logits [R, V] at temperatures `scale` [R, 1], and
    their per-block sums as `inverse_cdf` reads them (None: not computed). With the backend's kernels (the
    CPU's with AVX-512F or AVX2: csrc/exp_blocks.c, exp((x - max) / t) and the block sums in one pass, ~3x
    torch's softmax here); elsewhere torch's softmax (its kernel reads bf16 as it goes: twice as fast here as the
    same steps one op at a time)."""
    done = _exp_pass(logits, scale, exp, write_probs=True)
    if done is None:
        return torch.softmax(_scaled(logits, scale), dim=-1, dtype=torch.float32), None
    return done.probs, done.sums


class _ExpPass(NamedTuple):
    logits: torch.Tensor  # [R, V], contiguous
    probs: torch.Tensor | None  # [R, V] float32, when written
    sums: torch.Tensor  # [R, blocks]
    row_max: torch.Tensor  # [R]
    inverse_t: torch.Tensor  # [R]: 1 / temperature


def _exp_pass(logits: torch.Tensor, scale: torch.Tensor, exp: ExpKernels | None,
              write_probs: bool) -> _ExpPass | None:
    """The backend's pass over logits at temperatures `scale`, or None where it has none for them."""
    if exp is None or logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32):
        return None
    kernel = exp.blocks
    x = logits.contiguous()
    r, v = x.shape
    c = min(_BLOCK, v)
    probs = torch.empty(r, v, dtype=torch.float32) if write_probs else None
    sums = torch.empty(r, -(-v // c), dtype=torch.float32)
    row_max = torch.empty(r, dtype=torch.float32)
    inverse_t = (1.0 / scale.to(torch.float32)).reshape(r).contiguous()
    kernel(x.data_ptr(), x.dtype == torch.bfloat16, r, v, inverse_t.data_ptr(),
           None if probs is None else probs.data_ptr(), sums.data_ptr(), c, row_max.data_ptr())
    return _ExpPass(x, probs, sums, row_max, inverse_t)


# Vocabulary-sized scans run as two levels over blocks of this many columns: a reduction per block
# (which vectorizes), then one block per row. On the CPU, torch's argmax over 200k columns is 5-10x
# slower than its amax, and a full cumsum several times slower than a sum.
_BLOCK = 1024


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-block reductions' input: x [B, V] (rows contiguous) as [B, n, C] over its first n*C columns,
    without a copy; the last V - n*C columns form a shorter block of their own."""
    b, v = x.shape
    c = min(_BLOCK, v)
    return x.as_strided((b, v // c, c), (x.stride(0), c, 1)), c


def _per_block(x: torch.Tensor, reduce) -> tuple[torch.Tensor, int]:
    """`reduce` over each block of each row: [B, blocks], and the block width."""
    head, c = _blocks(x)
    out = reduce(head, -1)
    tail = x[:, head.shape[1] * c :]
    if tail.shape[1]:
        out = torch.cat([out, reduce(tail, -1, keepdim=True)], dim=1)
    return out, c


def _block_columns(x: torch.Tensor, block: torch.Tensor, c: int, fill: float):
    """The columns of one block per row (`block` [B]): their values [B, C] (`fill` past the row's end)
    and their indices [B, C]."""
    cols = block.unsqueeze(1) * c + torch.arange(c, device=x.device)
    past = cols >= x.shape[1]
    return x.gather(1, cols.clamp(max=x.shape[1] - 1)).masked_fill_(past, fill), cols


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum [B], as torch.argmax (which on the CPU scans 200k columns
    5-10x slower than a blocked max, then the one block that holds it). bf16 rows are compared as they
    are: converting them to float32 first is faster on logits already in cache, but slower on the LM
    head's fresh output, which is what a step has (bench/RESULTS.md#cpu-kernels)."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    x = x.contiguous()
    maxes, c = _per_block(x, torch.amax)
    values, cols = _block_columns(x, maxes.argmax(dim=-1), c, NEG_INF)
    return cols.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """For unnormalized probabilities [B, V] and uniforms u [B] in [0, 1): the first index where each row's
    running sum exceeds u times its total. Block sums and their running sum find the block, then a
    running sum within that block alone finds the index: no full-vocabulary cumsum. Each row's result
    depends on that row alone, so a seeded request samples the same tokens in any batch. `sums`: the
    per-block sums when the caller has them (as `_per_block` lays them out)."""
    probs = probs.contiguous()
    if sums is None:
        sums, c = _per_block(probs, torch.sum)
    else:
        c = min(_BLOCK, probs.shape[1])
    return _pick(u, sums, lambda block: _block_columns(probs, block, c, 0.0))


def _pick(u: torch.Tensor, sums: torch.Tensor, block_values) -> torch.Tensor:
    """inverse_cdf from the per-block sums [B, blocks]: `block_values(block [B])` gives the probs of each
    row's chosen block [B, C] (0 past the row's end) and their columns [B, C]."""
    cdf = sums.cumsum_(dim=-1)  # [B, blocks]
    target = u.unsqueeze(1) * cdf[:, -1:]  # [B, 1]
    # A u that rounds to 1 puts the target at the total, past every block: take the last block with mass
    # (the first to reach the total), never a masked tail.
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    block = torch.minimum(torch.searchsorted(cdf, target, right=True), last)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    values, cols = block_values(block.squeeze(1))
    pos = torch.searchsorted(values.cumsum(dim=-1), target - before, right=True)  # [B, 1]
    # rounding can put the target past the block's own running sum: take its last token with mass
    last = torch.where(values > 0, torch.arange(values.shape[1], device=values.device), 0).amax(dim=-1,
                                                                                              keepdim=True)
    return cols.gather(1, torch.minimum(pos, last)).squeeze(1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Raw logprob and rank of `tokens` [R] under logits [R, V], with the top-k alternatives."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1))  # [R, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1
    top = lp.topk(k, dim=-1) if k else None
    chosen, ranks = chosen.squeeze(1).tolist(), ranks.tolist()
    top_ids = top.indices.tolist() if top else [[]] * len(chosen)
    top_lps = top.values.tolist() if top else [[]] * len(chosen)
    return [TokenLogprobs(c, r, i, v) for c, r, i, v in zip(chosen, ranks, top_ids, top_lps)]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k_max = int(top_k.max())
    kth = logits.topk(min(k_max, logits.shape[1]), dim=-1).values  # [B, k_max]
    idx = (top_k.clamp(min=1, max=kth.shape[1]) - 1).unsqueeze(1)
    threshold = kth.gather(1, idx)
    threshold = torch.where(top_k.unsqueeze(1) > 0, threshold, torch.finfo(logits.dtype).min)
    return logits.masked_fill(logits < threshold, NEG_INF)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = (top_p < 1.0).nonzero().squeeze(1)  # only rows that ask for it pay for the sort
    sub = logits[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop_sorted = before > top_p[rows].unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits = logits.clone()
    logits[rows] = sub.masked_fill(drop, NEG_INF)
    return logits
