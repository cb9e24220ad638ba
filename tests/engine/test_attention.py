"""The grouped float32 attention the CPU runner uses for batched decodes (and gpt-oss's sinks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.attention import _attention


def _inputs(seed, b, h, hkv, nq, k, d=8):
    g = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(n, generator=g) for n in ((b, h, nq, d), (b, hkv, k, d), (b, hkv, k, d)))
    mask = torch.rand(b, 1, nq, k, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    return q, kk, v, mask


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 5), st.sampled_from([(4, 4), (4, 2), (8, 2), (6, 1)]),
       st.integers(1, 3), st.integers(1, 40))
def test_grouped_attention_is_sdpa(seed, b, heads, nq, k):
    q, kk, v, mask = _inputs(seed, b, *heads, nq, k)
    want = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(_attention(q, kk, v, mask, 0.3), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 4), st.sampled_from([(4, 2), (8, 1)]), st.integers(1, 3),
       st.integers(1, 30))
def test_sinks_take_their_share_of_the_softmax(seed, b, heads, nq, k):
    """Against the plain form: k/v repeated per query head, one extra logit per head, dropped after softmax."""
    h, hkv = heads
    q, kk, v, mask = _inputs(seed, b, h, hkv, nq, k)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(seed + 1))
    rk, rv = kk.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ rk.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, h, 1, 1).expand(b, h, nq, 1)
    want = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ rv
    torch.testing.assert_close(_attention(q, kk, v, mask, 0.3, sinks), want, atol=1e-5, rtol=1e-5)
