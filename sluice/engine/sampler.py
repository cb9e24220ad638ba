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
from typing import Callable, NamedTuple

import numpy as np
import torch

from sluice.engine.grammar import GrammarState, apply_grammars
from sluice.engine.sequence import Sequence

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
        if (temp < _GREEDY_EPS).all():  # nothing below reads the per-row tensors of an all-greedy batch
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
            all_greedy=bool((temp < _GREEDY_EPS).all()),
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


def plain_greedy(seq: Sequence) -> bool:
    """True when the sequence's next token is the argmax of its raw logits and nothing else reads them:
    greedy, no logprobs, and none of `process_logits`'s constraints or penalties can apply."""
    sp = seq.sampling
    return (sp.temperature < _GREEDY_EPS and sp.logprobs is None and seq.grammar is None
            and not (sp.allowed_token_ids or sp.bad_words_ids or sp.logit_bias or sp.needs_penalties)
            and not (len(seq.output_ids) < sp.min_tokens and sp.stop_token_ids))


def greedy_held(seq: Sequence) -> bool:
    """True when the sequence's next token is the argmax of its raw logits over what its grammar allows, and
    nothing else reads them: then the plain argmax, if the grammar allows it, is that token."""
    sp = seq.sampling
    return (sp.temperature < _GREEDY_EPS and sp.logprobs is None and seq.grammar is not None
            and seq.grammar.active and not (sp.allowed_token_ids or sp.bad_words_ids or sp.logit_bias
                                            or sp.needs_penalties))


@dataclass
class _Constraints:
    """What `process_logits` does to a batch, row by row."""

    allowed: list[tuple[int, list[int]]]
    grammar_rows: list[int]
    banned_rows: list[int]
    banned_ids: list[int]
    bias_rows: list[int]
    bias_ids: list[int]
    bias_vals: list[float]
    penalized: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "_Constraints":
        c = cls([(r, s.sampling.allowed_token_ids) for r, s in enumerate(seqs) if s.sampling.allowed_token_ids],
                [r for r, s in enumerate(seqs) if s.grammar is not None and s.grammar.active], [], [], [], [], [], [])
        grammar_rows = set(c.grammar_rows)
        for r, s in enumerate(seqs):
            sp = s.sampling
            out = s.output_ids
            for word in sp.bad_words_ids:
                if len(word) == 1 or out[len(out) - len(word) + 1 :] == word[:-1]:
                    c.banned_rows.append(r)
                    c.banned_ids.append(word[-1])
            if len(out) < sp.min_tokens and r not in grammar_rows:  # a grammar decides where its output ends
                c.banned_rows += [r] * len(sp.stop_token_ids)
                c.banned_ids += sp.stop_token_ids
            for tok, bias in sp.logit_bias.items():
                c.bias_rows.append(r)
                c.bias_ids.append(tok)
                c.bias_vals.append(bias)
            if sp.needs_penalties:
                c.penalized.append(r)
        return c

    def masks_only(self) -> bool:
        """Whether every constraint only rules tokens out: -inf is exact in any dtype, so they can go in place
        on the model's logits (no float32 copy of the whole batch for one held row)."""
        return not (self.bias_rows or self.penalized)

    def __bool__(self) -> bool:
        """Whether any constraint applies."""
        return bool(self.allowed or self.grammar_rows or self.banned_rows or self.bias_rows or self.penalized)

    def rows(self) -> list[int]:
        return sorted({r for r, _ in self.allowed} | set(self.grammar_rows) | set(self.banned_rows)
                      | set(self.bias_rows) | set(self.penalized))

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place, in vLLM's order."""
        vocab, dev = logits.shape[1], logits.device
        if self.grammar_rows:
            apply_grammars(logits, self.grammar_rows, [_grammar(seqs[r]) for r in self.grammar_rows])
        if self.allowed:
            rows = torch.tensor([r for r, _ in self.allowed], device=dev)
            keep = torch.zeros(len(self.allowed), vocab + 1, dtype=torch.bool, device=dev)
            keep.scatter_(1, _padded([ids for _, ids in self.allowed], vocab, dev).clamp_(max=vocab), True)
            logits[rows] = logits[rows].masked_fill(~keep[:, :vocab], _NEG_INF)
            self._starve(logits, seqs, [r for r, _ in self.allowed], "allowed_token_ids")
        if self.banned_rows:
            ids = torch.tensor(self.banned_ids, device=dev)
            ok = ids < vocab
            logits[torch.tensor(self.banned_rows, device=dev)[ok], ids[ok]] = _NEG_INF
            self._starve(logits, seqs, self.banned_rows, "bad_words")
        if self.bias_rows:
            ids = torch.tensor(self.bias_ids, device=dev)
            ok = ids < vocab
            logits[torch.tensor(self.bias_rows, device=dev)[ok], ids[ok]] += \
                torch.tensor(self.bias_vals, device=dev)[ok]
        if self.penalized:
            _apply_penalties(logits, [seqs[r] for r in self.penalized], torch.tensor(self.penalized, device=dev))

    def _starve(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], field: str) -> None:
        """Fails the grammar rows among `rows` that `field` has left no token (the client's constraints
        contradict each other), rather than let them sample one their grammar refuses."""
        held = sorted(set(rows).intersection(self.grammar_rows))
        if not held:
            return
        alive = torch.isfinite(logits[torch.tensor(held, device=logits.device)]).any(1).tolist()
        for r, ok in zip(held, alive):
            if not ok:
                _grammar(seqs[r]).starve(field)


def _grammar(seq: Sequence) -> GrammarState:
    assert seq.grammar is not None  # (a grammar row's)
    return seq.grammar


def process_logits(logits: torch.Tensor, seqs: list[Sequence], c: _Constraints | None = None) -> torch.Tensor:
    """Applies each request's constraints and penalties to logits [B, V] (a new float32 tensor when any
    applies)."""
    if c is None:
        c = _Constraints.of(seqs)
    if not c:
        return logits
    logits = logits.to(torch.float32, copy=True)
    c.apply(logits, seqs)
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
    """logits: [B, V] in the model's dtype (values are compared and scaled in float32) -> token ids [B].
    The request's constraints apply first; logits are as they came when it returns (logprobs read them)."""
    if sb.seqs is None:
        return _sample(logits, sb)
    c = _Constraints.of(sb.seqs)
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
    is_greedy = sb.temperature < _GREEDY_EPS
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
    CPU's with AVX-512: csrc/exp_blocks.c, exp((x - max) / t) and the block sums in one pass, ~3x torch's
    softmax here); elsewhere torch's softmax (its kernel reads bf16 as it goes: twice as fast here as the
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
    head's fresh output (1.1-1.2 against 0.8 ms at batch 16), which is what a step has."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    x = x.contiguous()
    maxes, c = _per_block(x, torch.amax)
    values, cols = _block_columns(x, maxes.argmax(dim=-1), c, _NEG_INF)
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
