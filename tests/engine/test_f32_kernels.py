"""A model served in float32 on the CPU: Sluice's float32 kernels (engine/csrc/f32_matmul.c, f32_layers.c;
AVX-512F; on CPUs with AVX2 and FMA only csrc/f32_matmul_avx2.c for the linears and f32_layers.c built for
AVX2) against torch's float32 path, which the kernels must equal up to the order of their sums.

- The linears, on each instruction set this CPU has: one float32 multiply-add chain over k in order (bit
  for bit), so F.linear's products up to the order of the sums (float64 reference), for bf16 weights
  widened in registers and float32 ones; a row's values depend neither on its batch nor on the threads;
  the AVX2 kernel gives the AVX-512 kernel's bits; the argmax is the first index of the maximum of those
  logits.
- A bf16 checkpoint served in float32 keeps its weights in bf16 (the same values); a float32 one keeps
  float32.
- Attention, rotary with the KV store, RMSNorm (and Qwen3's q/k norms), SwiGLU, on each instruction set
  this CPU has: torch's float32 values within float32 rounding; a whole step through the layers in one call:
  the op-by-op torch path's hidden states and cache, and the same greedy tokens over whole generations.
- A CPU without AVX-512 (SLUICE_CPU_HIDE=avx512f) runs the step in one call on the AVX2 build (see
  test_avx2_step.py); one without AVX2 either, and disabled kernels, run torch's path: the same tokens.
"""
from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.app.builtin_models import write_llama_family
from sluice.engine.attention import cache_row, store_rows, widened
from sluice.engine.backend import TORCH
from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu import kernels, ops
from sluice.engine.cpu.matmul import Bf16Screen, F32Matmul, Int8Argmax, bf16_exact, narrowed
from sluice.engine.cpu.stack import DecoderStack
from sluice.engine.lm_head import lm_head
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner
from tests.engine.helpers import generate, make_engine, seq

_ISA = {"avx512f", "avx512bw", "avx512vl"}
AVX512 = _ISA <= kernel_build.cpu_flags()
AVX2 = {"avx2", "fma"} <= kernel_build.cpu_flags()
needs_avx512 = pytest.mark.skipif(not AVX512, reason="this CPU lacks AVX-512F/BW/VL")
needs_avx2 = pytest.mark.skipif(not AVX2, reason="this CPU lacks AVX2/FMA")
needs_f32_kernel = pytest.mark.skipif(not (AVX512 or AVX2), reason="this CPU lacks AVX-512F/BW/VL and AVX2/FMA")
# the float32 linears' instruction sets: each test of them runs on every one this CPU has
ISAS = [pytest.param("AVX-512F", marks=needs_avx512), pytest.param("AVX2", marks=needs_avx2)]
# the caches the float32 kernels read (--kv-cache-dtype)
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# the float32 step's pieces (f32_layers.c) on each build this CPU runs
STEP_ISAS = [pytest.param(kernels.f32_layers, id="AVX-512F", marks=needs_avx512),
             pytest.param(kernels.f32_layers_avx2, id="AVX2", marks=needs_avx2)]
AMX = {*_ISA, "avx512_bf16", "amx_tile", "amx_bf16"} <= kernel_build.cpu_flags()
BF16 = {*_ISA, "avx512_bf16", "avx512_vnni"} <= kernel_build.cpu_flags()  # (the bf16 screen's build)
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU lacks AMX-BF16")


@pytest.fixture
def fresh_kernels():
    """No kernel loaded yet (the builds stay cached: a build's key holds its instruction sets, so a CPU with
    some hidden finds only builds it could have made)."""
    kernel_build.clear()
    yield
    kernel_build.clear()


def _kernel(isa: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> F32Matmul:
    """The float32 linear on one instruction set's library (F32Matmul.build takes the best this CPU has)."""
    lib = kernels.f32_layers() if isa in ("AVX-512F", "AMX") else kernels.f32_matmul_avx2()
    assert lib is not None, f"the {isa} float32 kernel did not build"
    if isa == "AMX":
        assert kernels.f32_amx(), "the AMX build of the float32 kernels did not load"
        kernel = F32Matmul(lib, "AVX-512F", weight, bias, amx=True)
        assert kernel.isa == "AMX"
        return kernel
    return F32Matmul(lib, isa, weight, bias)


def _step_on(build):
    """ops' float32 kernels from one build of f32_layers.c (ops takes the best this CPU has)."""
    assert build() is not None, f"{build.__name__} did not build"
    return mock.patch.object(kernels, "f32_step", build)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (an FMA), from float64 math: the product of two float32 values is exact
    in float64 and the sum's error is exact (two-sum); float64's rounding is off float32's only where it
    lands on a float32 midpoint with an error left, which then decides the side."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.inf, -torch.inf).float())
    tie = (r.double() != s) & ((r.double() + other.double()) / 2 == s) & (err != 0)
    toward = torch.where(err > 0, torch.maximum(r, other), torch.minimum(r, other))
    return torch.where(tie, toward, r)


def _in_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as one float32 FMA chain over k in order, + bias in float32: the kernels'
    values, bit for bit."""
    w = weight.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(x.shape[1]):
        acc = _fma(x[:, i : i + 1], w[:, i], acc)
    return acc if bias is None else acc + bias


def _order_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound on how far two float32 sums of the products x @ w^T in different orders can lie from the
    exact value: k roundings of at most 2^-24 of the running sum of |products|."""
    return x.abs().double() @ w.abs().double().T * x.shape[1] * 2**-23 + 1e-30


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), k=st.integers(1, 80).map(lambda h: 2 * h), rows=st.integers(1, 70),
       bf16=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_float32_matmul_is_one_fma_chain_over_k_in_order(isa, n, k, rows, bf16, bias, seed):
    """Bit for bit, whatever the rows (1 to 70: every row block and its tail), the outputs (tails of a tile,
    of a vector, of a block of tiles), the columns, the bias and the weight's dtype."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    kernel = _kernel(isa, weight, b)
    assert kernel.bf16 == bf16
    assert torch.equal(kernel(x), _in_order(x, weight, b))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [97, 250])
def test_float32_matmul_over_panels_of_rows_is_one_fma_chain_over_k_in_order(isa, rows):
    """A prompt's many rows go a panel at a time (k = 2,048: panels of 96 rows on AVX2, 240 on AVX-512F), each
    thread taking (panel, block of tiles) units: the same bits as one chain over k, the last panel short, and
    each row's argmax its own."""
    g = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(200, 2048, generator=g).bfloat16(), torch.randn(200)
    x = torch.randn(rows, 2048, generator=g)
    kernel = _kernel(isa, weight, b)
    assert torch.equal(kernel(x), _in_order(x, weight, b))
    assert torch.equal(kernel.argmax(x), _kernel(isa, weight)(x).argmax(dim=1))


@pytest.mark.parametrize("isa", ISAS)
def test_float32_matmul_rows_do_not_depend_on_the_threads(isa):
    g = torch.Generator().manual_seed(0)
    weight, x, b = torch.randn(1000, 576, generator=g).bfloat16(), torch.randn(7, 576, generator=g), torch.randn(1000)
    kernel = _kernel(isa, weight, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, tokens = kernel(x), kernel.argmax(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel(x), alone) and torch.equal(alone, _in_order(x, weight, b))
    assert torch.equal(kernel.argmax(x), tokens)


@needs_avx512
@needs_avx2
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3000), k=st.integers(1, 300).map(lambda h: 2 * h), rows=st.integers(1, 70),
       bf16=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_avx2_kernel_gives_the_avx512_kernels_bits(n, k, rows, bf16, bias, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    avx512, avx2 = _kernel("AVX-512F", weight, b), _kernel("AVX2", weight, b)
    assert torch.equal(avx2(x), avx512(x)) and torch.equal(avx2.argmax(x), avx512.argmax(x))


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), k=st.integers(1, 80).map(lambda h: 2 * h), rows=st.integers(1, 70),
       bf16=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_float32_matmul_is_f_linear_up_to_the_order_of_its_sums(isa, n, k, rows, bf16, bias, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    kernel = _kernel(isa, weight, b)
    out = kernel(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert ((out.double() - exact).abs() <= _order_tolerance(x, weight.float()) + 2**-23 * exact.abs()).all()
    torch_fp32 = F.linear(x, weight.float(), b)
    assert ((out - torch_fp32).double().abs() <= 2 * _order_tolerance(x, weight.float())
            + 2**-22 * exact.abs()).all()
    alone = torch.cat([kernel(x[r : r + 1]) for r in range(rows)])
    assert torch.equal(alone, out), "a row's values depend on its batch"


@needs_avx512
@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 6), k=st.integers(1, 80).map(lambda h: 2 * h), rows=st.integers(1, 70),
       bf16=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_float32_swiglu_matmul_is_silu_of_the_gate_times_the_up_product(groups, k, rows, bf16, bias, seed):
    """A SwiGLU's stacked gate-and-up linear with silu(gate) * up in the product's epilogue: the same products
    as the plain kernel's (bit for bit), then torch's silu and multiply within float32 rounding; a row's values
    do not depend on its batch."""
    g = torch.Generator().manual_seed(seed)
    inter = 64 * groups
    weight = torch.randn(2 * inter, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(2 * inter, generator=g) if bias else None
    kernel = _kernel("AVX-512F", weight, b)
    assert kernel.swiglu_ok
    out = kernel.swiglu(x)
    assert out.shape == (rows, inter) and out.dtype == torch.float32
    gate, up = kernel(x).double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert ((out.double() - exact).abs() <= 2**-20 * exact.abs() + 1e-30).all()
    assert torch.equal(torch.cat([kernel.swiglu(x[r : r + 1]) for r in range(rows)]), out)


@needs_avx512
def test_long_prompts_on_large_weights_keep_the_bits():
    """Rows past one panel (f32_matmul.c's F32_PANEL_BYTES of them: 510 rows of k = 1024) and a bf16 weight
    past F32_FETCH_BYTES (4.25 MiB: its next slices fetched while one is multiplied), widened once a panel:
    the values of 16 rows at a time (no panel, no widening, no fetching; bit-exact by the tests above), for
    the plain product and SwiGLU's."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(2 * 1088, 1024, generator=g).bfloat16(), torch.randn(1100, 1024, generator=g)
    kernel = _kernel("AVX-512F", weight)
    assert kernel.bf16 and kernel.swiglu_ok
    for product in (kernel, kernel.swiglu):
        assert torch.equal(product(x), torch.cat([product(x[r : r + 16]) for r in range(0, 1100, 16)]))


@needs_avx512
def test_swiglu_in_the_epilogue_needs_whole_groups_of_64():
    """Elsewhere the product runs whole, then f32_layers.c's SwiGLU over it: torch's values."""
    odd, whole = _kernel("AVX-512F", torch.randn(2 * 88, 32)), _kernel("AVX-512F", torch.randn(2 * 128, 32))
    assert whole.swiglu_fused and whole.swiglu_ok and not odd.swiglu_fused and odd.swiglu_ok
    x = torch.randn(5, 32)
    gate, up = odd(x).chunk(2, dim=-1)
    torch.testing.assert_close(odd.swiglu(x), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def _amx_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound on AMX's error against the exact products: its rows' three bf16 parts are exact (x = hi + mid +
    lo) and so are their products; each block of 32 columns of a part lands in the float32 sum with one
    rounding of at most 2^-24 of the running sum of |products|, and a block's own sum with as much again."""
    blocks = 3 * -(-x.shape[1] // 32)
    return x.abs().double() @ w.abs().double().T * (2 * blocks + 2) * 2**-24 + 1e-30


@needs_amx
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), k=st.integers(1, 12).map(lambda h: 32 * h), rows=st.integers(1, 70),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_amx_matmul_is_float32_math_on_the_same_bf16_weights(n, k, rows, bias, seed):
    """AMX's products (a bf16 weight, K a multiple of 32): the exact products within a few float32 roundings of
    each block of 32 columns (far inside the order tolerance of a float32 chain over k), torch's float32
    F.linear up to the order of its sums, and a row's values the same whatever its batch (1 to 70 rows: tiles
    of fewer than 16 rows, whole ones and a last partial one)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    kernel = _kernel("AMX", weight, b)
    out = kernel(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert ((out.double() - exact).abs() <= _amx_tolerance(x, weight.float()) + 2**-23 * exact.abs()).all()
    torch_fp32 = F.linear(x, weight.float(), b)
    assert ((out - torch_fp32).double().abs() <= 2 * _order_tolerance(x, weight.float()) + 2**-22 * exact.abs()).all()
    alone = torch.cat([kernel(x[r : r + 1]) for r in range(rows)])
    assert torch.equal(alone, out), "a row's values depend on its batch"


@needs_amx
def test_amx_rows_do_not_depend_on_the_threads_and_long_prompts_keep_the_bits():
    """One thread or two, and 1,100 rows of k = 1024 (past one panel of rows, a last tile of 12 rows) against
    16 rows at a time, for the plain product and SwiGLU's; the argmax is the first index of the maximum of
    AMX's logits."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(2 * 1088, 1024, generator=g).bfloat16(), torch.randn(1100, 1024, generator=g)
    kernel = _kernel("AMX", weight)
    assert kernel.swiglu_ok
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(x[:40])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel(x[:40]), alone)
    for product in (kernel, kernel.swiglu):
        assert torch.equal(product(x), torch.cat([product(x[r : r + 16]) for r in range(0, 1100, 16)]))
    gate, up = kernel(x[:70]).double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert ((kernel.swiglu(x[:70]).double() - exact).abs() <= 2**-20 * exact.abs() + 1e-30).all()
    logits = kernel(x[:70])
    assert torch.equal(kernel.argmax(x[:70]), (logits == logits.amax(dim=1, keepdim=True)).float().argmax(dim=1))


@needs_amx
@pytest.mark.parametrize("rows", [485, 490, 495])
def test_amx_writes_a_last_short_panel_of_rows_and_nothing_past_the_output(rows):
    """A product of more than 16 rows whose last panel of rows holds fewer than 16 (k = 1,024: panels of 480
    rows): its tiles were configured for 16 rows, so that panel must go through the whole tiles' path and
    write its own rows only (a tile stored whole would run past the output's last row)."""
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(256, 1024, generator=g).bfloat16(), torch.randn(rows, 1024, generator=g)
    kernel = _kernel("AMX", weight)
    out = torch.full((rows + 16, 256), float("nan"))
    assert kernel.fn(kernel.packed.data_ptr(), kernel.mode, kernel.n, kernel.k, x.data_ptr(), x.stride(0), rows,
                     None, out.data_ptr(), kernel.n, None) == 0
    assert out[rows:].isnan().all(), "rows written past the output"
    assert torch.equal(out[:rows], torch.cat([kernel(x[r : r + 16]) for r in range(0, rows, 16)]))


@needs_amx
def test_amx_takes_bf16_weights_whose_k_is_a_multiple_of_32_and_no_others():
    assert F32Matmul.build(torch.randn(64, 96).bfloat16()).isa == "AMX"
    assert F32Matmul.build(torch.randn(64, 88).bfloat16()).isa == "AVX-512F"  # K not a multiple of 32
    assert F32Matmul.build(torch.randn(64, 96)).isa == "AVX-512F"  # a float32 weight
    assert F32Matmul.build(torch.randn(64, 96).bfloat16(), amx=False).isa == "AVX-512F"


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 3000), rows=st.integers(1, 70), ties=st.integers(0, 5), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_float32_argmax_is_the_first_index_of_the_maximum_of_its_logits(isa, vocab, rows, ties, bf16, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, 64, generator=g)
    hidden = torch.randn(rows, 64, generator=g)
    if bf16:
        weight = weight.bfloat16()
    for i in range(min(ties, vocab - 1)):  # equal rows give equal logits: the first index must win
        weight[vocab - 1 - i] = weight[i]
        hidden[i % rows] = weight[i].float() * 4
    logits = _kernel(isa, weight)(hidden)
    tokens = _kernel(isa, weight, torch.randn(vocab, generator=g)).argmax(hidden)  # (the bias ignored)
    first_max = (logits == logits.amax(dim=1, keepdim=True)).float().argmax(dim=1)
    assert torch.equal(tokens, first_max)
    assert torch.equal(tokens, torch.cat([_kernel(isa, weight).argmax(hidden[r : r + 1]) for r in range(rows)]))


@needs_f32_kernel
def test_the_float32_lm_head_runs_the_best_kernel_this_cpu_has_and_says_which():
    weight = torch.randn(3000, 64).bfloat16()
    hidden = torch.randn(5, 64)
    head = lm_head(weight, torch.float32)
    isa = "AMX" if AMX else "AVX-512F" if AVX512 else "AVX2"
    assert isinstance(head.kernel, F32Matmul) and head.kernel.isa == isa and head.kernel.bf16
    assert f"({isa}, the weight in bf16)" in head.path
    logits = head(hidden)
    assert torch.equal(logits, _kernel(isa, weight)(hidden))
    assert torch.equal(head.argmax(hidden), logits.argmax(dim=1))


def screen_case(vocab: int, dim: int, rows: int, ties: int, cluster: int, outlier: bool, g: torch.Generator,
                eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """An LM head's weight [vocab, dim] and hidden rows for its int8 screen: random rows; exact ties (copies: the
    first index wins) and copies one float32 step off, with hidden rows along them; a cluster of close rows (eps
    apart) with hidden rows along it (top logits closer than the int8 error); a hidden outlier column (coarse
    quantization)."""
    weight, hidden = torch.randn(vocab, dim, generator=g), torch.randn(rows, dim, generator=g)
    cluster = min(cluster, vocab)
    if cluster:
        base = torch.randn(dim, generator=g) * 3
        weight[-cluster:] = base + eps * torch.randn(cluster, dim, generator=g)
        hidden = base + eps * hidden
    for i in range(min(ties, vocab // 2)):
        j = int(torch.randint(vocab, (1,), generator=g))
        weight[vocab - 1 - i] = weight[j]
        if i % 2:
            weight[vocab - 1 - i, 0] = torch.nextafter(weight[j, 0], torch.tensor(9.0))
        hidden[i % rows] = weight[j] * 3
    if outlier:
        hidden[:, 0] = 60
    return weight, hidden


needs_vnni = pytest.mark.skipif(not _ISA | {"avx512_vnni"} <= kernel_build.cpu_flags(), reason="no AVX512-VNNI")


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 3000), dim=st.sampled_from([4, 32, 128, 260]), rows=st.integers(1, 40),
       ties=st.integers(0, 8), cluster=st.integers(0, 60), eps=st.sampled_from([1e-4, 0.01, 1.0]),
       bf16=st.booleans(), outlier=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_screened_float32_argmax_is_the_float32_kernels(vocab, dim, rows, ties, cluster, eps, bf16, outlier,
                                                               seed):
    """The screen settles every row on the float32 kernel's token (bf16 and float32 weights): random rows,
    exact ties (the first index), near copies one step apart, and a cluster of close rows with hidden rows
    along it (top logits closer than the int8 error). A bf16 weight off AMX is screened in bf16 where the CPU
    has AVX512-BF16 (the weight's own tiles), else in int8."""
    weight, hidden = screen_case(vocab, dim, rows, ties, cluster, outlier, torch.Generator().manual_seed(seed), eps)
    if bf16:
        weight = weight.bfloat16()
    head = lm_head(weight, torch.float32)
    on_amx = AMX and bf16 and dim % 32 == 0
    assert head.kernel.isa == ("AMX" if on_amx else "AVX-512F")  # (AMX: settled there)
    assert isinstance(head.screen, Bf16Screen if bf16 and BF16 and not on_amx else Int8Argmax)
    assert torch.equal(head.screen(hidden), head.kernel.argmax(hidden))


@pytest.mark.skipif(not BF16, reason="this CPU lacks AVX512-BF16")
def test_a_bf16_screen_settles_rows_the_int8_one_redoes():
    """Rows with a few large values (a trained model's final hidden rows: max / rms about 20): an int8 row's
    error is max |x| / 254 on every value, so its screen keeps too many columns and redoes the row; rounding x
    to bf16 moves each value by 2^-9 of itself, and the bf16 screen settles every row, on the kernel's tokens
    (an exact tie among them)."""
    g = torch.Generator().manual_seed(7)
    weight, hidden = (torch.randn(16000, 512, generator=g) * 0.02).bfloat16(), torch.randn(24, 512, generator=g)
    hidden[:, :3] *= 100  # (three outlier values a row: the int8 bound about a standard deviation of the logits)
    weight[-2] = weight[-1]  # (an exact tie: the first index wins)
    hidden[0] = weight[-1].float() * 20
    kernel = F32Matmul.build(weight, amx=False)
    bf16, int8 = Bf16Screen.build(kernel, weight), Int8Argmax.build(kernel, weight)
    want = kernel.argmax(hidden)
    assert torch.equal(bf16(hidden), want) and torch.equal(int8(hidden), want)
    assert bf16.redone == 0 and int8.redone > 12


@needs_f32_kernel
def test_bf16_values_in_float32_are_kept_in_bf16_and_others_are_not():
    w = torch.randn(300, 64)
    assert not bf16_exact(w) and narrowed(w).dtype == torch.float32
    w16 = w.bfloat16().float()
    assert bf16_exact(w16) and torch.equal(narrowed(w16).float(), w16) and narrowed(w16).dtype == torch.bfloat16
    assert F32Matmul.build(narrowed(w16)).bf16 and not F32Matmul.build(narrowed(w)).bf16
    assert F32Matmul.build(torch.randn(4, 3)) is None  # odd K: torch's path


def _bf16_checkpoint(path, **kw):
    """write_llama_family's checkpoint with its weights rounded to bf16 (what a bf16 checkpoint loads as)."""
    from safetensors.torch import load_file, save_file

    write_llama_family(path, **kw)
    for file in path.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(str(file)).items()}, str(file), metadata={"format": "pt"})
    return path


VARIANTS = {
    "llama-gqa": dict(architecture="LlamaForCausalLM", tie_word_embeddings=False),
    "qwen3-qk-norm": dict(architecture="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_dim=32),
    "qwen2-bias-one-kv-head": dict(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=1, head_dim=32,
                                   intermediate_size=88),
    "mistral-window-12": dict(architecture="MistralForCausalLM", sliding_window=12, num_kv_heads=4, head_dim=48,
                              hidden_size=96, intermediate_size=200),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3, list(range(100, 171, 2))]


def _engines(path, **kw):
    """(Sluice's float32 kernels, torch's float32 path) over the same checkpoint."""
    fast = make_engine(path, **kw)
    with mock.patch("sluice.engine.model_runner.select_backend", return_value=TORCH):
        plain = make_engine(path, **kw)
    return fast, plain


@needs_f32_kernel
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_bf16_checkpoint_in_float32_keeps_bf16_weights_and_generates_torch_fp32_tokens(variant, tmp_path):
    """The layers of a step in one call (AVX-512F, else AVX2), the linears on that instruction set's kernel."""
    path = _bf16_checkpoint(tmp_path / variant, **VARIANTS[variant])
    (runner, sched), (ref, ref_sched) = _engines(path, block_size=8)
    isa = "AVX-512F" if AVX512 else "AVX2"
    assert runner.one_call
    assert isinstance(runner.lm_head.kernel, F32Matmul) and runner.lm_head.kernel.bf16
    linears = [m for m in runner.model.modules() if hasattr(m, "run")]
    assert linears and all(isinstance(m.run, F32Matmul) and m.run.bf16 and m.weight.dtype == torch.bfloat16
                           for m in linears)
    # on AMX a bf16 weight whose K is a multiple of 32 runs there, the others on AVX-512F
    assert all(m.run.isa == ("AMX" if AMX and m.run.k % 32 == 0 else isa) for m in linears)
    # (torch's path: the weights as loaded, in bf16, each product's widened to float32)
    assert all(m.run is None and m.weight.dtype == torch.bfloat16 for m in ref.model.modules() if hasattr(m, "run"))
    tied = runner.model.tied_embedding()  # (the table held once: the head's packed copy)
    assert (tied is None) == (variant == "llama-gqa")
    assert (runner.model.lm_head if tied is None else tied).weight.numel() == 0
    requests = [seq(f"r{i}", p, max_tokens=24, temperature=0.0) for i, p in enumerate(PROMPTS)]
    assert generate(runner, sched, requests) == generate(ref, ref_sched, [seq(s.request_id, s.token_ids[:len(p)],
                                                                            max_tokens=24, temperature=0.0)
                                                                        for s, p in zip(requests, PROMPTS)])


@needs_avx512
@pytest.mark.parametrize("variant", ["qwen3-qk-norm", "llama-gqa"])
@pytest.mark.parametrize("budget", [2048, 256])  # whole prompts, or chunks of them
def test_long_prompts_take_the_causal_kernel_and_generate_torch_fp32_tokens(variant, budget, tmp_path):
    """Prompts too long for the step in one call (rows x keys past 65,536) run their attention on
    csrc/causal_attention.c, whole and padded to the longest in their group, or in chunks from a later
    position: torch's float32 tokens."""
    path = _bf16_checkpoint(tmp_path / variant, **VARIANTS[variant])
    (runner, sched), (ref, ref_sched) = _engines(path, block_size=16, num_blocks=512, budget=budget)
    prompts = [[(3 * i) % 390 + 5 for i in range(600)], [(5 * i) % 400 for i in range(181)],
               list(range(40, 300))[::-1]]
    with mock.patch.object(ops, "paged_causal_attention", wraps=ops.paged_causal_attention) as kernel, \
            mock.patch.object(F32Matmul, "swiglu", autospec=True, side_effect=F32Matmul.swiglu) as swiglu:
        got = generate(runner, sched, [seq(f"r{i}", p, max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)])
    assert swiglu.call_count  # (the MLP's SwiGLU in its first linear's epilogue)
    assert kernel.call_count and all(c.args[4].shape[1] >= 181 for c in kernel.call_args_list)  # keys
    assert any(int(c.args[7].max()) > 0 for c in kernel.call_args_list) == (budget < 600)  # chunks after the first
    assert got == generate(ref, ref_sched, [seq(f"r{i}", p, max_tokens=8, temperature=0.0)
                                            for i, p in enumerate(prompts)])


@needs_f32_kernel
@pytest.mark.parametrize("bf16", [True, False])
def test_a_tied_table_is_held_once_the_embedding_reading_the_heads_packed_rows(bf16, tmp_path):
    """The embedding of a table tied to the LM head drops its copy and looks its rows up in the head kernel's
    packed one (bf16 tiles, or float32 pairs): the table's own rows, bit for bit; an id past the table is
    refused as nn.Embedding refuses it (the packed rows past it are zero padding). A bf16 checkpoint's linears
    and table are loaded in bf16 under float32 (never widened: loading peaks at the checkpoint's size)."""
    path = (_bf16_checkpoint if bf16 else write_llama_family)(tmp_path / "m", architecture="Qwen3ForCausalLM")
    model = load_model(path, torch.float32, torch.device("cpu"))
    linears = [m.weight.dtype for m in model.modules() if hasattr(m, "run")]
    assert linears and set(linears) == {torch.bfloat16 if bf16 else torch.float32}
    table = model.model.embed_tokens.weight.detach().float()
    runner, _ = make_engine(path)
    embedding = runner.model.model.embed_tokens
    assert runner.lm_head.kernel.bf16 == bf16 and embedding.lookup is not None
    assert embedding.weight.numel() == 0 and runner.lm_head.weight.numel() == 0
    ids = torch.tensor([[0, 5, len(table) - 1], [17, 5, 16]])
    assert torch.equal(embedding(ids).float(), table[ids]) and embedding(ids[:, :0]).shape == (2, 0, table.shape[1])
    for bad in (len(table), -1):
        with pytest.raises(IndexError):
            embedding(torch.tensor([3, bad]))
    # another runner over the same model (prepared again: its kernels kept) takes the head the table went to
    again = ModelRunner(runner.model, 64, 16, torch.float32, torch.device("cpu"))
    assert again.lm_head is runner.lm_head and torch.equal(embedding(ids).float(), table[ids])
    assert torch.equal(runner.model.lm_weight().float(), table)  # (a copy, from the head's packed rows)
    hidden = torch.randn(3, table.shape[1])
    assert torch.equal(again.lm_head.argmax(hidden), runner.lm_head.argmax(hidden))


@needs_f32_kernel
def test_a_float32_checkpoint_keeps_float32_weights(tmp_path):
    path = write_llama_family(tmp_path / "m", architecture="LlamaForCausalLM")
    runner, _ = make_engine(path)
    assert runner.one_call and not runner.lm_head.kernel.bf16
    assert all(not m.run.bf16 and m.weight.dtype == torch.float32 for m in runner.model.modules() if hasattr(m, "run"))


def _decoding(engine, prompts=PROMPTS):
    """The engine's sequences past their prompts, and its next (all-decode) batch."""
    runner, sched = engine
    for i, p in enumerate(prompts):
        sched.add(seq(f"r{i}", p, max_tokens=50, temperature=0.0))
    for _ in range(4):
        batch = sched.schedule()
        sched.update(batch, runner.run(batch).tokens)
    batch = sched.schedule()
    assert set(batch.num_new_tokens) == {1}
    return runner, batch


def _step(runner, batch):
    """(hidden states, the caches after the step), the caches put back as they were."""
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        hidden, _ = runner._hidden(batch)
    after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)
    return hidden, after


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_f32_kernel
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_float32_decode_step_on_the_kernels_is_torchs_layers_op_by_op(variant, tmp_path):
    """In one call (AVX-512F, else AVX2): torch's hidden states, cache and logits, up to the order of float32
    sums."""
    decode_step_is_torchs(_bf16_checkpoint(tmp_path / variant, **VARIANTS[variant]))


@needs_f32_kernel
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float16])
def test_a_16_bit_kv_cache_under_float32_is_torchs_layers_op_by_op_and_generates_their_tokens(kv, tmp_path):
    """--kv-cache-dtype bfloat16 / float16 under float32 activations: the step in one call writes and reads the
    16-bit cache as torch's path does (its keys and values rounded once as they are stored), and greedy
    decoding gives torch's tokens."""
    path = _bf16_checkpoint(tmp_path / "m", **VARIANTS["qwen3-qk-norm"])
    runner = decode_step_is_torchs(path, kv_dtype=kv)
    assert all(k.dtype == kv and v.dtype == kv for k, v in runner.kv_caches)
    (runner, sched), (ref, ref_sched) = _engines(path, block_size=8, kv_dtype=kv)
    requests = [seq(f"r{i}", p, max_tokens=24, temperature=0.0) for i, p in enumerate(PROMPTS)]
    assert generate(runner, sched, requests) == generate(
        ref, ref_sched, [seq(f"r{i}", p, max_tokens=24, temperature=0.0) for i, p in enumerate(PROMPTS)])


def decode_step_is_torchs(path, **kw):
    """Checks a decode step of the checkpoint's float32 engine, run in one call, against torch's path (hidden
    states, cache, logits); returns that engine's runner. `kw`: make_engine's."""
    fast, plain = _engines(path, block_size=8, **kw)
    runner, batch = _decoding(fast)
    ref, ref_batch = _decoding(plain)
    with mock.patch.object(DecoderStack, "__call__", autospec=True, side_effect=DecoderStack.__call__) as spy:
        hidden, caches = _step(runner, batch)
    assert spy.called
    ref_hidden, ref_caches = _step(ref, ref_batch)
    # a 16-bit cache: a key the two paths rotate a float32 bit apart may round to neighbouring 16-bit values
    # (one rounding apart), and the attention over it moves by about that much
    rounding = {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(kw.get("kv_dtype"), 1e-4)
    close = 1e-4 if rounding == 1e-4 else 2e-3
    torch.testing.assert_close(hidden, ref_hidden, rtol=close, atol=close)
    for kv, ref_kv in zip(caches, ref_caches):
        for x, y in zip(kv, ref_kv):
            torch.testing.assert_close(x.float(), y.float(), rtol=rounding, atol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(runner.lm_head(hidden), ref.lm_head(ref_hidden), rtol=close, atol=close)
    return runner


@needs_f32_kernel
def test_float32_steps_with_prefill_chunks_in_one_call_are_torchs(tmp_path):
    """A chunk's rows attend as decodes of their positions (causal, within the window): torch's values."""
    path = _bf16_checkpoint(tmp_path / "m", **VARIANTS["mistral-window-12"])
    (runner, sched), (ref, ref_sched) = _engines(path, block_size=8, budget=19)
    requests = [*PROMPTS[:3], list(range(400, 440))]
    out, mixed, run = {}, [], DecoderStack.__call__

    def spy(stack, x, positions, slot_mapping, rows, kv_slots, mask):  # rows of one sequence share its keys
        mixed.append(len(torch.unique(kv_slots, dim=0)) < len(x))
        return run(stack, x, positions, slot_mapping, rows, kv_slots, mask)

    calls = mock.patch.object(DecoderStack, "__call__", autospec=True, side_effect=spy)
    with calls:
        for name, (r, s) in (("fast", (runner, sched)), ("ref", (ref, ref_sched))):
            out[name] = generate(r, s, [seq(f"r{i}", p, max_tokens=30, temperature=0.0)
                                        for i, p in enumerate(requests)])
    assert out["fast"] == out["ref"]
    assert sum(mixed) >= 2  # steps whose rows include a prompt's chunk ran in one call


@pytest.mark.parametrize("build", STEP_ISAS)
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 9), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3, 4, 6, 8]),
       dim=st.sampled_from([16, 32, 48, 64, 80, 128, 256]), keys=st.integers(1, 100), sinks=st.booleans(),
       kv=st.sampled_from(KV_DTYPES), seed=st.integers(0, 2**16))
def test_float32_decode_attention_is_the_torch_path(build, batch, kv_heads, group, dim, keys, sinks, kv, seed):
    """Over a float32 cache or a 16-bit one (--kv-cache-dtype: its keys and values widened as they are read)."""
    from sluice.engine.attention import _attention

    g = torch.Generator().manual_seed(seed)
    heads, num_slots, t = kv_heads * group, 200, batch + 3
    k_cache, v_cache = (_cache(torch.randn(num_slots, kv_heads, dim, generator=g), kv) for _ in range(2))
    q = torch.randn(t, heads + 2 * kv_heads, dim, generator=g)[:, :heads]  # a view, as in a model
    rows = torch.randperm(t, generator=g)[:batch]
    slots = torch.randint(0, num_slots, (batch, keys), generator=g)
    mask = torch.rand(batch, 1, 1, keys, generator=g) < 0.7
    mask[:, :, :, 0] = True
    sink = torch.randn(heads, generator=g) if sinks else None
    out = torch.zeros(t + 1, heads, dim)
    with _step_on(build):
        assert ops.decode_attention(q, k_cache, v_cache, rows, slots, mask, 0.3, sink, out)
    qg = q[rows].unsqueeze(1).transpose(1, 2)  # [B, H, 1, D]
    ref = _attention(qg, widened(k_cache[slots], torch.float32).transpose(1, 2),
                     widened(v_cache[slots], torch.float32).transpose(1, 2), mask, 0.3, sink).transpose(1, 2)[:, 0]
    torch.testing.assert_close(out[rows], ref, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(t + 1, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 0).all()


@pytest.mark.parametrize("build", STEP_ISAS)
@pytest.mark.parametrize("kv", [torch.float32, torch.float16, torch.int8])
def test_a_sequences_attention_is_the_same_bits_alone_or_among_others(build, kv):
    """A sequence's decode attention is the same bits whether it runs alone (one thread) or in a step of nine
    (both threads, jobs taken in any order): what a row attends to is its own, whatever runs beside it."""
    g = torch.Generator().manual_seed(7)
    batch, kv_heads, group, dim, keys = 9, 3, 3, 64, 300
    heads, num_slots = kv_heads * group, batch * keys
    k_cache, v_cache = (_cache(torch.randn(num_slots, kv_heads, dim, generator=g), kv) for _ in range(2))
    q = torch.randn(batch, heads, dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:batch * keys].view(batch, keys)
    mask = torch.rand(batch, 1, 1, keys, generator=g) < 0.9
    mask[:, :, :, 0] = True
    out = torch.zeros(batch, heads, dim)
    with _step_on(build):
        assert ops.decode_attention(q, k_cache, v_cache, torch.arange(batch), slots, mask, 0.125, None, out)
        for b in range(batch):
            alone = torch.zeros(1, heads, dim)
            assert ops.decode_attention(q[b:b + 1], k_cache, v_cache, torch.arange(1), slots[b:b + 1], mask[b:b + 1],
                                        0.125, None, alone)
            assert torch.equal(alone[0], out[b])


def _cache(values: torch.Tensor, kv: torch.dtype) -> torch.Tensor:
    """A cache [slots, Hkv, D] of dtype kv holding values [slots, Hkv, D] (store_rows: an int8 cache's rows
    with their scales)."""
    cache = torch.zeros(*values.shape[:-1], cache_row(kv, values.shape[-1]), dtype=kv)
    store_rows(cache, torch.arange(len(values)), values)
    return cache


def _chunked_prompts(chunks, kv_heads: int, group: int, dim: int, g):
    """q [B, Lq, H, D], k and v [B, Lk, Hkv, D] and starts [B] for prompt chunks (start, length), padded to the
    longest."""
    q_len = max(n for _, n in chunks)
    k_len = max(start + n for start, n in chunks)
    q = torch.randn(len(chunks), q_len, kv_heads * group, dim, generator=g)
    k, v = (torch.randn(len(chunks), k_len, kv_heads, dim, generator=g) for _ in range(2))
    return q, k, v, torch.tensor([start for start, _ in chunks])


@needs_avx512
@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 150), st.integers(1, 90)), min_size=1, max_size=3),
       kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 5, 16]),
       dim=st.sampled_from([16, 32, 48, 64, 128, 256]), seed=st.integers(0, 2**16))
def test_float32_causal_attention_is_the_masked_torch_path(chunks, kv_heads, group, dim, seed):
    """Prompts and prompt chunks (csrc/causal_attention.c): each sequence's queries from position `start`,
    padded to the longest, over its keys from position 0: torch's values for every real query within float32
    rounding, across the kernel's blocks of 64 keys and tiles of 16 queries, every grouping of query heads;
    whole prompts give SDPA's is_causal."""
    from sluice.engine.attention import _attention

    g = torch.Generator().manual_seed(seed)
    q, k, v, starts = _chunked_prompts(chunks, kv_heads, group, dim, g)
    q_len, k_len = q.shape[1], k.shape[1]
    out = ops.causal_attention(q, k, v, dim ** -0.5, starts)
    assert out is not None and out.shape == q.shape
    q_pos = starts[:, None] + torch.arange(q_len)[None, :]
    mask = (torch.arange(k_len)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Q, K]
    ref = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, dim ** -0.5).transpose(1, 2)
    for i, (_, n) in enumerate(chunks):  # the real queries (pads attend whatever keys there are)
        torch.testing.assert_close(out[i, :n], ref[i, :n], rtol=1e-5, atol=1e-5)
    k, v = k[:, :q_len], v[:, :q_len]  # whole prompts: keys and queries from position 0
    torch.testing.assert_close(ops.causal_attention(q, k, v, dim ** -0.5), F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=dim ** -0.5,
        enable_gqa=True).transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert ops.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1.0) is None  # (float32 only)


@needs_avx512
@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 70)), min_size=1, max_size=3),
       kv_heads=st.sampled_from([1, 3]), group=st.sampled_from([1, 3]), dim=st.sampled_from([16, 64, 128]),
       kv=st.sampled_from(KV_DTYPES), seed=st.integers(0, 2**16))
def test_paged_causal_attention_reads_queries_and_keys_where_they_lie(chunks, kv_heads, group, dim, kv, seed):
    """The same kernel reading a step's query rows and the cache's slots (scattered, as a paged cache holds
    them; float32, or 16- or 8-bit and widened) and writing its output rows where the step's outputs go: the
    dense call's values on the cache's values, bit for bit, and the pads' row untouched."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, starts = _chunked_prompts(chunks, kv_heads, group, dim, g)
    (b, q_len, heads, _), k_len = q.shape, k.shape[1]
    rows = b * q_len
    q_index = torch.randperm(rows, generator=g).view(b, q_len)  # each (sequence, query)'s row of the step
    kv_slots = torch.randperm(b * k_len + 50, generator=g)[: b * k_len].view(b, k_len)
    step_q = torch.empty(rows, heads, dim)
    step_q[q_index.view(-1)] = q.reshape(rows, heads, dim)
    k_cache, v_cache = (_cache(torch.randn(b * k_len + 50, kv_heads, dim, generator=g), kv) for _ in range(2))
    store_rows(k_cache, kv_slots.view(-1), k.reshape(-1, kv_heads, dim))
    store_rows(v_cache, kv_slots.view(-1), v.reshape(-1, kv_heads, dim))
    k, v = (widened(c[kv_slots.view(-1)], torch.float32).view(k.shape) for c in (k_cache, v_cache))  # (as held)
    dense = ops.causal_attention(q, k, v, dim ** -0.5, starts)
    out_index = torch.randperm(rows, generator=g).view(b, q_len)
    pads = torch.tensor([[i >= n for i in range(q_len)] for _, n in chunks])
    out_index[pads] = rows  # the pads' row
    out = torch.full((rows + 1, heads, dim), 7.0)
    assert ops.paged_causal_attention(step_q, k_cache, v_cache, q_index, kv_slots, out_index, dim ** -0.5, starts,
                                      out)
    assert torch.equal(out[out_index[~pads]], dense[~pads]) and (out[rows] == 7.0).all()


@pytest.mark.parametrize("build", STEP_ISAS)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), dim=st.integers(1, 300), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_float32_rms_norm_is_torchs(build, rows, dim, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim + (7 if strided else 0), generator=g) * 3)[:, :dim]
    weight = torch.randn(dim, generator=g) * 0.5 + 1
    with _step_on(build):
        out = ops.rms_norm(x, weight, 1e-6)
    assert out is not None and out.shape == (rows, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), weight, 1e-6), rtol=4e-7, atol=1e-6)


@pytest.mark.parametrize("build", STEP_ISAS)
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(0, 40), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3, 4]),
       dim=st.integers(1, 150).map(lambda n: 2 * n), kv=st.sampled_from(KV_DTYPES), seed=st.integers(0, 2**16))
def test_float32_rope_store_is_torchs_rotary_and_the_cache_writes(build, tokens, kv_heads, group, dim, kv, seed):
    """Into a float32 cache, or a 16-bit one (rounded to nearest even, as torch's conversion: the keys within
    one rounding of torch's, whose rotary differs in the last float32 bit, the values exact) where the head
    dim is a multiple of 16 up to 256 (whole vectors: others go to torch's path)."""
    from sluice.engine.attention import rope_and_store
    from sluice.engine.rope import Rotary

    g = torch.Generator().manual_seed(seed)
    heads, num_slots = kv_heads * group, 64
    rotary = Rotary(dim, 100, 10000.0, {"rope_type": "default"})
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g)
    positions = torch.randint(0, 100, (tokens,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    k_cache, v_cache = (torch.zeros(num_slots, kv_heads, cache_row(kv, dim), dtype=kv) for _ in range(2))
    with _step_on(build):
        q = ops.rope_store(qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], heads, positions, rotary.cos,
                           rotary.sin, slots, k_cache, v_cache)
    if kv != torch.float32 and (dim % 16 or dim > 256):
        assert q is None and not k_cache.any()
        return
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q2 = rope_and_store(qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], heads, rotary, positions, k2, v2, slots)
    torch.testing.assert_close(q, q2, rtol=1e-6, atol=1e-6)
    rounding = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float8_e4m3fn: 2**-2,
                torch.float8_e5m2: 2**-1, torch.int8: 0}[kv]  # (2 ulps where fp8's subnormals hold few bits)
    keys, keys2 = widened(k_cache, torch.float32), widened(k2, torch.float32)
    if kv == torch.int8:  # (a code apart at most: the rotary's last bit can move a value across a rounding)
        assert ((keys - keys2).abs() <= 1.01 * k2[..., dim:].contiguous().view(torch.float32) + 1e-6).all()
    else:
        torch.testing.assert_close(keys, keys2, rtol=rounding, atol=2**-9 if kv.itemsize == 1 else 1e-6)
    assert torch.equal(_bits(v_cache), _bits(v2))
    one, before = torch.randn(1, heads + 2 * kv_heads, dim, generator=g), (k_cache.clone(), v_cache.clone())
    for position, slot in ((100, 0), (0, num_slots), (-1, 0)):
        with _step_on(build), pytest.raises(IndexError):
            ops.rope_store(one[:, : heads + kv_heads], one[:, heads + kv_heads :], heads, torch.tensor([position]),
                           rotary.cos, rotary.sin, torch.tensor([slot]), k_cache, v_cache)
    assert torch.equal(_bits(k_cache), _bits(before[0])) and torch.equal(_bits(v_cache), _bits(before[1]))


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """A cache's elements as integers (torch.equal takes no float8)."""
    return cache.view(torch.uint8) if cache.itemsize == 1 else cache


@pytest.mark.parametrize("build", STEP_ISAS)
@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_holds_torchs_rounding_of_every_kind_of_value(build, kv):
    """Each float32 value the cache stores as torch converts it after clamping to the format's range (the torch
    path's store_rows): ties of every exponent to nearest even, subnormals and their ties, the largest finite
    value and past it (saturated), zeros of both signs and NaN."""
    info = torch.finfo(kv)
    mantissa = 3 if kv == torch.float8_e4m3fn else 2
    exps = torch.arange(math.log2(info.smallest_normal) - mantissa - 2, math.log2(info.max) + 2)
    steps = torch.arange(0, 2 ** (mantissa + 2) + 1) / 2 ** (mantissa + 1)  # halfway points between codes too
    grid = (2.0 ** exps[:, None] * (1 + steps[None, :])).flatten()
    values = torch.cat([grid, grid.nextafter(torch.tensor(0.0)), grid.nextafter(torch.tensor(math.inf)),
                        torch.tensor([0.0, 1e-30, info.max, 464.0, 480.0, 6e4, 61440.0, 1e9, math.inf, math.nan])])
    values = torch.cat([values, -values])
    values = torch.cat([values, torch.zeros(-len(values) % 64)]).view(-1, 1, 64)  # (rows of whole vectors)
    t, slots = len(values), torch.arange(len(values))
    k_cache, v_cache = (torch.zeros(t, 1, 64, dtype=kv) for _ in range(2))
    qk = torch.zeros(t, 2, 64)
    with _step_on(build):
        assert ops.rope_store(qk, values, 1, torch.zeros(t, dtype=torch.int64), torch.ones(1, 32), torch.zeros(1, 32),
                              slots, k_cache, v_cache) is not None
    want = torch.zeros_like(v_cache)
    store_rows(want, slots, values)
    assert torch.equal(_bits(v_cache), _bits(want))


@pytest.mark.parametrize("build", STEP_ISAS)
def test_an_int8_cache_holds_each_rows_codes_and_scale_as_the_torch_path(build):
    """--kv-cache-dtype int8: each (slot, kv head) row as its D codes round(x / s) (to nearest even) and then
    s = max |x| / 127, bit for bit as store_rows writes them: rows of every magnitude, a row of zeros (codes 0,
    s 0), halves that round to even."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(40, 3, 64, generator=g) * torch.logspace(-30, 30, 40)[:, None, None]
    values[3] = 0.0
    values[5, :, :9] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 3.5])  # (s = 1: ties)
    t, slots = len(values), torch.arange(len(values))
    k_cache, v_cache = (torch.zeros(t, 3, cache_row(torch.int8, 64), dtype=torch.int8) for _ in range(2))
    with _step_on(build):
        assert ops.rope_store(torch.zeros(t, 6, 64), values, 3, torch.zeros(t, dtype=torch.int64), torch.ones(1, 32),
                              torch.zeros(1, 32), slots, k_cache, v_cache) is not None
    assert torch.equal(v_cache, _cache(values, torch.int8))
    assert v_cache[5, 0, :9].tolist() == [127, 0, 2, 2, 0, -2, 126, -126, 4]
    assert not v_cache[3].any()
    err = (widened(v_cache, torch.float32) - values).abs()
    assert (err <= values.abs().amax(-1, keepdim=True) / 254 * 1.0001).all()  # (half a code)


@pytest.fixture(scope="module")
def best_path_tokens(tmp_path_factory):
    """A checkpoint and its greedy tokens on the best path this CPU has."""
    path = _bf16_checkpoint(tmp_path_factory.mktemp("hidden") / "m", **VARIANTS["qwen3-qk-norm"])
    runner, sched = make_engine(path)
    return path, generate(runner, sched, [seq(f"r{i}", p, max_tokens=16, temperature=0.0)
                                          for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("hide", ["amx_bf16", "avx512f", "avx512f,avx2", "all"])
def test_cpus_without_the_instructions_run_other_paths_with_the_same_tokens(hide, best_path_tokens, fresh_kernels,
                                                                          monkeypatch):
    """SLUICE_CPU_HIDE stands for a CPU without those instructions (amx_bf16: AVX-512 without AMX; avx512f: AVX2
    alone; avx512f,avx2: neither) and SLUICE_CPU_KERNELS=0 for kernels turned off. What runs follows from what
    the host has once they are hidden (on an AVX2 host hiding AMX changes nothing): the whole step in one call
    on AVX-512F where AVX-512F/BW/VL remain, on f32_layers.c's AVX2 build where only AVX2/FMA do, no kernel
    at all otherwise. The tokens are those of the best path the host has."""
    if hide != "all" and not set(hide.split(",")) & kernel_build.cpu_flags():
        pytest.skip(f"this CPU has none of {hide}: hiding them is the run without hiding")
    path, tokens = best_path_tokens
    if hide == "all":
        monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    else:  # (beside what the run hides already: a whole suite run as a smaller CPU)
        monkeypatch.setenv("SLUICE_CPU_HIDE", ",".join(filter(None, [os.environ.get("SLUICE_CPU_HIDE"), hide])))
    kernel_build.clear()
    left = kernel_build.cpu_flags() if hide != "all" else frozenset()
    runner, sched = make_engine(path)
    linears = [m for m in runner.model.modules() if hasattr(m, "run")]
    assert runner.one_call == (_ISA <= left or {"avx2", "fma"} <= left)
    if _ISA <= left:
        isas = {m.run.isa for m in linears}
        assert isas <= ({"AVX-512F", "AMX"} if AMX and "amx_bf16" in left else {"AVX-512F"}), isas
    elif {"avx2", "fma"} <= left:
        assert isinstance(runner.lm_head.kernel, F32Matmul) and runner.lm_head.kernel.isa == "AVX2"
        assert all(m.run.isa == "AVX2" and m.weight.dtype == torch.bfloat16 for m in linears)
        assert runner.model.model.stack.stack.fn == kernels.f32_layers_avx2().sluice_f32_layers
    else:
        assert runner.lm_head.kernel is None
        assert all(m.run is None and m.weight.dtype == torch.float32 for m in linears)
    assert generate(runner, sched, [seq(f"r{i}", p, max_tokens=16, temperature=0.0)
                                    for i, p in enumerate(PROMPTS)]) == tokens


@needs_f32_kernel
@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_8_bit_cache_runs_in_the_one_call_step_with_the_torch_paths_tokens(kv, best_path_tokens, fresh_kernels,
                                                                               monkeypatch):
    """--kv-cache-dtype int8 / fp8 / fp8_e5m2: the whole step in one call reads and writes the 8-bit cache, and
    its greedy tokens are those of torch's path over the same cache (the same stored bytes, attention's sums in
    another order)."""
    path, _ = best_path_tokens
    runner, sched = make_engine(path, kv_dtype=kv)
    assert runner.one_call and {c.dtype for pair in runner.kv_caches for c in pair} == {kv}
    prompts = [seq(f"r{i}", p, max_tokens=16, temperature=0.0) for i, p in enumerate(PROMPTS)]
    tokens = generate(runner, sched, prompts)
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    kernel_build.clear()
    runner, sched = make_engine(path, kv_dtype=kv)
    assert not runner.one_call
    assert generate(runner, sched, [seq(f"r{i}", p, max_tokens=16, temperature=0.0)
                                    for i, p in enumerate(PROMPTS)]) == tokens


@needs_f32_kernel
def test_hiding_avx512_bf16_leaves_the_float32_path_and_takes_the_bf16_kernels_away(fresh_kernels, monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_HIDE", "avx512_bf16,avx512_vnni")
    weight = torch.randn(300, 64).bfloat16()
    assert lm_head(weight).kernel is None  # bf16 rows: oneDNN
    assert isinstance(lm_head(weight, torch.float32).kernel, F32Matmul)
