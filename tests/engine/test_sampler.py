from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.sampler import SamplingBatch, sample, uniform_from
from sluice.ipc.messages import SamplingParams

EXP = CpuBackend(torch.float32).exp_kernels()  # (the CPU's kernels where this CPU runs them)


def _batch(params, seeds=None, steps=None):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), steps or [0] * n, torch.device("cpu"), exp=EXP)


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    out = sample(logits, _batch([SamplingParams(1, temperature=0.0)] * 4))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seeded_row_is_independent_of_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    p = SamplingParams(1, temperature=1.0)
    full = sample(logits, _batch([p] * 8, seeds=[11 * i for i in range(8)], steps=[3] * 8))
    for i in range(8):
        alone = sample(logits[i : i + 1], _batch([p], seeds=[11 * i], steps=[3]))
        assert alone.item() == full[i].item()


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(300, 1)
    seeds = list(range(300))
    def support(**kw):
        return set(sample(logits, _batch([SamplingParams(1, **kw)] * 300, seeds=seeds)).tolist())
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.5) == {0}  # token 0 alone holds ~0.66 of the mass
    assert support(min_p=0.3) == {0, 1}  # p1/p0 = e^-1 ≈ 0.37
    assert support(top_k=3, temperature=100.0) == {0, 1, 2}
    assert support(temperature=1.0) >= {0, 1, 2}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    out = sample(logits, _batch([SamplingParams(1)] * 4000, seeds=list(range(4000))))
    freq = np.bincount(out.numpy(), minlength=3) / 4000
    assert np.allclose(freq, probs.numpy(), atol=0.03)


def test_uniforms_are_in_range_and_vary_with_seed_and_step():
    u = uniform_from(np.arange(1000, dtype=np.uint64), np.zeros(1000, dtype=np.uint64))
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 1000
    assert uniform_from(np.array([5], np.uint64), np.array([1], np.uint64)) != uniform_from(
        np.array([5], np.uint64), np.array([2], np.uint64))


def _seq(output=(), prompt=(1, 2), **kw):
    from sluice.engine.sequence import Sequence

    s = Sequence("r", list(prompt), SamplingParams(100, **kw), seed=0)
    s.token_ids += list(output)
    return s


def test_processors_leave_untouched_rows_alone():
    from sluice.engine.logit_constraints import process_logits

    logits = torch.randn(2, 10)
    assert process_logits(logits, [_seq(), _seq()]) is logits


def test_bias_bans_and_allowed_ids():
    from sluice.engine.logit_constraints import process_logits

    logits = torch.zeros(4, 8)
    seqs = [
        _seq(logit_bias={3: 5.0, 7: -2.0}),
        _seq(allowed_token_ids=[1, 6]),
        _seq(output=[4, 5], bad_words_ids=[[2], [4, 5, 6], [9, 9, 1]]),  # 2 always; 6 after "4 5"
        _seq(output=[0], min_tokens=3, stop_token_ids=(7, 1)),  # stop ids masked until 3 tokens
    ]
    out = process_logits(logits, seqs)
    assert out[0].tolist() == [0, 0, 0, 5, 0, 0, 0, -2]
    assert torch.isinf(out[1]).tolist() == [i not in (1, 6) for i in range(8)]
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [2, 6]
    assert torch.isinf(out[3]).nonzero().flatten().tolist() == [1, 7]
    assert logits.eq(0).all()  # the input is not modified


def test_penalties():
    from sluice.engine.logit_constraints import process_logits

    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]]).repeat(3, 1)
    seqs = [
        _seq(output=[2, 2, 3], presence_penalty=0.5),
        _seq(output=[2, 2, 3], frequency_penalty=0.5),
        _seq(output=[3], prompt=[0, 1], repetition_penalty=2.0),  # prompt tokens count too
    ]
    out = process_logits(logits, seqs)
    assert out[0].tolist() == [2.0, -2.0, 0.5, 0.5]
    assert out[1].tolist() == [2.0, -2.0, 0.0, 0.5]
    assert out[2].tolist() == [1.0, -4.0, 1.0, 0.5]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["free", "allowed", "banned", "min_tokens", "bias"]), min_size=1, max_size=6),
       st.sampled_from([0.0, 0.7, 1.0]), st.integers(0, 2**32 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_masks_go_in_place_and_leave_the_logits_as_they_came(kinds, temperature, seed, dtype):
    """Rows whose constraints only rule tokens out are masked on the model's logits, not on a float32 copy of
    the batch: the same tokens as that copy gives, and the logits (logprobs read them) come back unchanged."""
    from sluice.engine.logit_constraints import process_logits

    vocab = 1500
    per_kind = {"free": {}, "allowed": {"allowed_token_ids": [3, 700, 1499]},
                "banned": {"bad_words_ids": [[5], [9]]}, "min_tokens": {"min_tokens": 4, "stop_token_ids": (7,)},
                "bias": {"logit_bias": {11: 3.0}}}
    seqs = [_seq(output=[1], temperature=temperature, **per_kind[k]) for k in kinds]
    for i, s in enumerate(seqs):
        s.seed = seed + i
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    raw = logits.clone()
    got = sample(logits, SamplingBatch.for_seqs(seqs, torch.device("cpu"), EXP))
    assert torch.equal(logits, raw)
    plain = SamplingBatch.for_seqs(seqs, torch.device("cpu"), EXP)
    plain.seqs = None
    assert got.tolist() == sample(process_logits(raw, seqs), plain).tolist()


def test_logprobs_are_raw_with_ranks():
    from sluice.engine.sampler import logprobs_of

    logits = torch.tensor([[1.0, 3.0, 2.0]])
    (entry,) = logprobs_of(logits, torch.tensor([2]), k=2)
    lp = logits.log_softmax(-1)[0]
    assert entry.rank == 2 and entry.logprob == pytest.approx(lp[2].item())
    assert entry.top_ids == [1, 2] and entry.top_logprobs == pytest.approx([lp[1].item(), lp[2].item()])


# The blocked scans span one block and a shorter last one (1024 + 40 columns) in these.
_WIDE = 1064


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 2 * _WIDE), st.integers(0, 2**32 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_blocked_argmax_is_torch_argmax_ties_included(rows, vocab, seed, dtype):
    from sluice.engine.sampler import argmax

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # few values: many ties
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax(x[:, : vocab // 2 + 1].contiguous()).tolist() == x[:, : vocab // 2 + 1].argmax(-1).tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 2 * _WIDE), st.integers(0, 2**32 - 1), st.data())
def test_inverse_cdf_is_the_full_running_sum_search(rows, vocab, seed, data):
    """Small integer masses and u = j/1024 keep every sum exact in float32: the two-level search must
    pick exactly the token a full cumsum and searchsorted picks, zero-mass tokens never."""
    from sluice.engine.sampler import inverse_cdf

    g = torch.Generator().manual_seed(seed)
    probs = torch.randint(0, 4, (rows, vocab), generator=g).float()
    probs[:, torch.randint(0, vocab, (1,), generator=g)] = 1.0  # every row has some mass
    u = torch.tensor([data.draw(st.integers(0, 1023)) / 1024 for _ in range(rows)])
    cdf = probs.double().cumsum(dim=-1)
    want = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    got = inverse_cdf(probs, u)
    assert got.tolist() == want.tolist()
    assert (probs.gather(1, got.unsqueeze(1)) > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_uniform_that_rounds_to_one_never_picks_a_token_without_mass(dtype):
    """u = 1 - 2^-53 is 1.0 in float32: the target is then the whole total. The old search fell past the
    last block with mass into a masked tail (a grammar's masked token, sampled)."""
    from sluice.engine.sampler import inverse_cdf

    probs = torch.zeros(2, 3 * _WIDE)
    probs[0, 7] = probs[1, _WIDE + 2] = 1.0
    u = torch.tensor([1 - 2**-53] * 2, dtype=torch.float64)
    assert inverse_cdf(probs, u.to(torch.float32)).tolist() == [7, _WIDE + 2]
    logits = probs.log().to(dtype)
    params = [SamplingParams(1, temperature=1.0)] * 2
    sb = _batch(params)
    sb.uniform.fill_(1 - 2**-53)
    assert sample(logits, sb).tolist() == [7, _WIDE + 2]


def test_seeded_rows_over_a_wide_vocabulary_are_independent_of_the_batch_and_follow_it():
    torch.manual_seed(1)
    logits = torch.randn(8, 3 * _WIDE) * 3
    p = SamplingParams(1, temperature=0.8)
    full = sample(logits, _batch([p] * 8, seeds=[7 * i for i in range(8)], steps=[5] * 8))
    for i in range(8):
        assert sample(logits[i : i + 1], _batch([p], seeds=[7 * i], steps=[5])).item() == full[i].item()
    probs = torch.tensor([0.25, 0.25, 0.5])
    wide = torch.full((3000, 3 * _WIDE), float("-inf"))
    wide[:, [5, _WIDE + 3, 3 * _WIDE - 1]] = probs.log()  # one token in each block, the last in the tail
    out = sample(wide, _batch([SamplingParams(1)] * 3000, seeds=list(range(3000))))
    freq = [(out == t).float().mean().item() for t in (5, _WIDE + 3, 3 * _WIDE - 1)]
    assert np.allclose(freq, probs.numpy(), atol=0.03)


def test_bfloat16_logits_sample_as_their_float32_values():
    torch.manual_seed(2)
    logits = (torch.randn(6, 3 * _WIDE) * 4).bfloat16()
    for kw in ({"temperature": 0.0}, {"temperature": 0.7, "top_k": 50}, {"temperature": 1.0, "min_p": 0.05}):
        params = [SamplingParams(1, **kw)] * 6
        assert sample(logits, _batch(params)).tolist() == sample(logits.float(), _batch(params)).tolist()


def test_top_k_top_p_apply_to_their_rows_in_any_chunk_of_the_batch():
    """The CPU sampler works a few rows at a time: rows asking for top-k / top-p may sit in one chunk only."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(24, 1)
    plain, top_k, top_p = SamplingParams(1, temperature=100.0), SamplingParams(1, top_k=2), SamplingParams(1, top_p=0.5)
    params = [plain] * 10 + [top_k] * 7 + [top_p] * 7
    for seed in range(20):
        out = sample(logits, _batch(params, seeds=[seed * 24 + i for i in range(24)])).tolist()
        assert set(out[10:17]) <= {0, 1} and set(out[17:]) == {0}
