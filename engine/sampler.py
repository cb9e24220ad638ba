"""Batched sampling: one pass over [B, V] logits, no per-request loop over the vocabulary.

Order (as vLLM): allowed_token_ids, the structured-output grammar, bad words, min_tokens, logit_bias, the
repetition / frequency / presence penalties, temperature, top-k, top-p, min-p.
Sampling is inverse-CDF with one uniform number per row, drawn from a hash of
(request seed, output position): a seeded request gets the same tokens alone,
in any batch, and after a preemption. Logprobs are those of the model's raw
distribution, before any of the above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar import apply_grammars
from engine.sequence import Sequence

_GREEDY_EPS = 1e-5
_NEG_INF = float("-inf")


def uniform_from(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A uniform float in [0, 1) per row from splitmix64(seed, step)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (steps.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = ids
    return torch.from_numpy(out).to(device)


@dataclass
class TokenLogprobs:
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


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
    seqs: list[Sequence] | None = None  # for the per-request processors below

    @classmethod
    def build(cls, params: list, seeds: list[int], steps: list[int], device: torch.device,
              seqs: list[Sequence] | None = None) -> "SamplingBatch":
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
            seqs=seqs,
        )

    @classmethod
    def for_seqs(cls, seqs: list[Sequence], device: torch.device) -> "SamplingBatch":
        return cls.build([s.sampling for s in seqs], [s.seed for s in seqs], [s.num_output_tokens for s in seqs],
                         device, seqs)


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Applies each request's constraints and penalties to logits [B, V] (a new tensor when any applies)."""
    vocab = logits.shape[1]
    allowed = [(r, s.sampling.allowed_token_ids) for r, s in enumerate(seqs) if s.sampling.allowed_token_ids]
    constrained = [r for r, s in enumerate(seqs) if s.grammar is not None and s.grammar.active]
    banned_rows, banned_ids = [], []
    bias_rows, bias_ids, bias_vals = [], [], []
    penalized = []
    for r, s in enumerate(seqs):
        sp = s.sampling
        out = s.output_ids
        for word in sp.bad_words_ids:
            if len(word) == 1 or out[len(out) - len(word) + 1 :] == word[:-1]:
                banned_rows.append(r)
                banned_ids.append(word[-1])
        if len(out) < sp.min_tokens:
            banned_rows += [r] * len(sp.stop_token_ids)
            banned_ids += sp.stop_token_ids
        for tok, bias in sp.logit_bias.items():
            bias_rows.append(r)
            bias_ids.append(tok)
            bias_vals.append(bias)
        if sp.needs_penalties:
            penalized.append(r)
    if not (allowed or constrained or banned_rows or bias_rows or penalized):
        return logits
    logits = logits.clone()
    dev = logits.device
    if constrained:
        apply_grammars(logits, constrained, [seqs[r].grammar for r in constrained])
    if allowed:
        rows = torch.tensor([r for r, _ in allowed], device=dev)
        keep = torch.zeros(len(allowed), vocab + 1, dtype=torch.bool, device=dev)
        keep.scatter_(1, _padded([ids for _, ids in allowed], vocab, dev).clamp_(max=vocab), True)
        logits[rows] = logits[rows].masked_fill(~keep[:, :vocab], _NEG_INF)
    if banned_rows:
        ids = torch.tensor(banned_ids, device=dev)
        ok = ids < vocab
        logits[torch.tensor(banned_rows, device=dev)[ok], ids[ok]] = _NEG_INF
    if bias_rows:
        ids = torch.tensor(bias_ids, device=dev)
        ok = ids < vocab
        logits[torch.tensor(bias_rows, device=dev)[ok], ids[ok]] += torch.tensor(bias_vals, device=dev)[ok]
    if penalized:
        _apply_penalties(logits, [seqs[r] for r in penalized], torch.tensor(penalized, device=dev))
    return logits


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor) -> None:
    vocab, dev = logits.shape[1], logits.device
    out_ids = _padded([s.output_ids for s in seqs], vocab, dev)
    counts = torch.zeros(len(seqs), vocab + 1, device=dev).scatter_add_(1, out_ids, torch.ones_like(
        out_ids, dtype=torch.float32))[:, :vocab]  # [R, V] output token counts
    prompt_ids = _padded([s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab, dev)
    seen = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, prompt_ids, True)[:, :vocab]
    seen |= counts > 0
    col = lambda values: torch.tensor(values, device=dev, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    rep = col([s.sampling.repetition_penalty for s in seqs])
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - col([s.sampling.frequency_penalty for s in seqs]) * counts
    sub = sub - col([s.sampling.presence_penalty for s in seqs]) * (counts > 0)
    logits[rows] = sub


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B]."""
    if sb.seqs is not None:
        logits = process_logits(logits, sb.seqs)
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    is_greedy = sb.temperature < _GREEDY_EPS
    any_greedy = bool(is_greedy.any())
    greedy = logits.argmax(dim=-1) if any_greedy else None
    logits = logits / torch.where(is_greedy, 1.0, sb.temperature).unsqueeze(1)
    if sb.any_top_k:
        logits = _apply_top_k(logits, sb.top_k)
    if sb.any_top_p:
        logits = _apply_top_p(logits, sb.top_p)
    # One working buffer (`logits` is our own copy by now): every full-vocabulary allocation costs page
    # faults that dwarf the arithmetic. Unnormalized probabilities suffice, since the target below is
    # scaled by each row's total; after the shift each row's largest is 1, which min-p compares against.
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    if sb.any_min_p:
        probs.mul_(probs >= sb.min_p.unsqueeze(1))
    # float32: several times faster than float64; each row's sum is the same alone or batched, so
    # seeded requests stay reproducible.
    cdf = probs.cumsum_(dim=-1)  # [B, V]
    target = (sb.uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    return torch.where(is_greedy, greedy, sampled) if any_greedy else sampled


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
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = (top_p < 1.0).nonzero().squeeze(1)  # only rows that ask for it pay for the sort
    sub = logits[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop_sorted = before > top_p[rows].unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits = logits.clone()
    logits[rows] = sub.masked_fill(drop, _NEG_INF)
    return logits
