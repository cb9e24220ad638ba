from __future__ import annotations

import numpy as np
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
