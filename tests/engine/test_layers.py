"""The CPU backend's torch paths give F.linear's values: the packed LM head, the row-bucketed linears and the
small ones run in float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sluice.engine.backend import TORCH
from sluice.engine.cpu.backend import BucketedLinear, CpuBackend, row_bucket
from sluice.engine.layers import Linear, RMSNorm
from sluice.engine.lm_head import lm_head


@given(st.integers(1, 5000))
def test_row_buckets_are_few_and_waste_at_most_a_quarter(n):
    b = row_bucket(n)
    assert n <= b <= max(n, 16) * 1.25 and row_bucket(b) == b


def test_row_buckets_below_2049_are_a_few_dozen():
    assert len({row_bucket(n) for n in range(1, 2049)}) <= 16 + 4 * 7


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.sampled_from([torch.bfloat16, torch.float32]), st.booleans())
def test_bucketed_linear_is_f_linear(rows, dtype, bias):
    torch.manual_seed(rows)
    layer = Linear(64, 48, bias=bias).to(dtype)
    layer.run = BucketedLinear(layer.weight, layer.bias)
    x = torch.randn(rows, 64).to(dtype)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_linear_prepared_again_after_a_weight_loaded_in_place_runs_the_new_weight():
    """Weights are packed once, at `prepare`, and held only packed (the layer's weight an empty placeholder): a
    weight loaded after it is a new one, and needs `prepare` again; prepared again without one, the kernel stays."""
    layer = Linear(64, 48, bias=True).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    backend = CpuBackend(torch.bfloat16)
    backend.prepare(layer, [])
    first = layer.run
    assert layer.weight.numel() == 0 and torch.equal(layer(x), first(x))
    backend.prepare(layer, [])
    assert layer.run is first
    layer.weight = nn.Parameter(torch.randn(48, 64).bfloat16(), requires_grad=False)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(48))
    weight = layer.weight.detach().clone()
    backend.prepare(layer, [])
    assert layer.run is not first
    torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=1e-2, atol=1e-2)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)
    TORCH.prepare(layer, [])
    assert layer.run is None and torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 70), st.sampled_from([torch.bfloat16, torch.float32]))
def test_packed_lm_head_is_f_linear(rows, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(5000, 64).to(dtype)
    hidden = torch.randn(rows, 64).to(dtype)
    head = lm_head(weight)
    # bf16 logits: two float32 sums in different orders may round to neighbouring bf16 values (one ulp, up to
    # 2^-7 of the value; seen where torch's own bf16 product runs on AMX)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), atol=1e-4,
                               rtol=1e-3 if dtype == torch.float32 else 2**-7)
    assert head(hidden).dtype == dtype


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.sampled_from([32, 128, 2880]), st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_rms_norm_has_the_float32_paths_bits(rows, dim, dtype):
    """torch's half-precision path (Sluice's bf16 kernel aside: tests/engine/test_cpu_kernels.py)."""
    torch.manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.5 + 1)
    norm = norm.to(dtype)
    x = (torch.randn(rows, dim) * 3).to(dtype)
    ref = F.rms_norm(x.float(), (dim,), norm.weight.float(), 1e-6).to(dtype)
    assert torch.equal(norm(x), ref)  # (a module not prepared for a backend runs torch's path)
