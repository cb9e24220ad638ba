from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampler import SamplingBatch, sample, uniform_from
from ipc.messages import SamplingParams


def _batch(params, seeds=None, steps=None):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), steps or [0] * n, torch.device("cpu"))


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
    from engine.sequence import Sequence

    s = Sequence("r", list(prompt), SamplingParams(100, **kw), seed=0)
    s.token_ids += list(output)
    return s


def test_processors_leave_untouched_rows_alone():
    from engine.sampler import process_logits

    logits = torch.randn(2, 10)
    assert process_logits(logits, [_seq(), _seq()]) is logits


def test_bias_bans_and_allowed_ids():
    from engine.sampler import process_logits

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
    from engine.sampler import process_logits

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


def test_logprobs_are_raw_with_ranks():
    from engine.sampler import logprobs_of

    logits = torch.tensor([[1.0, 3.0, 2.0]])
    (entry,) = logprobs_of(logits, torch.tensor([2]), k=2)
    lp = logits.log_softmax(-1)[0]
    assert entry.rank == 2 and entry.logprob == pytest.approx(lp[2].item())
    assert entry.top_ids == [1, 2] and entry.top_logprobs == pytest.approx([lp[1].item(), lp[2].item()])
