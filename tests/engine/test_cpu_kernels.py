"""Sluice's C kernels for the CPU. The bf16 matmul (engine/csrc/bf16_matmul.c), as the LM head and the
small linears: its products are F.linear's, its argmax is the argmax of those logits (first index of a
tie). Sampling's exp pass (engine/csrc/exp_blocks.c, built for AVX-512F and for AVX2): torch's exp within
float32 rounding, masked tokens exactly 0, block sums as the sampler reads them. Decode attention over the
paged cache, rotary with the KV store, and RMSNorm: the torch paths' values within bf16 rounding. A row's
result never depends on its batch, and the engine falls back to torch when a kernel cannot be built."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu import kernels, ops
from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.matmul import Bf16Matmul, Int8Argmax
from sluice.engine.layers import Linear
from sluice.engine.lm_head import lm_head
from sluice.engine.sampler import (ExpKernels, SamplingBatch, _draw_from_sums, _per_block, argmax, exp_blocks,
                                   inverse_cdf, sample)
from tests.engine.helpers import generate, make_engine, seq

_ISA = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
def _exp(isa: tuple[str, ...] | None = None) -> ExpKernels | None:
    """The CPU backend's kernels for the sampler's exp pass (None where they cannot run), or csrc/exp_blocks.c
    built for `isa` (what a CPU whose widest is that runs: the build, not the choice, is under test)."""
    if isa is None:
        return CpuBackend(torch.float32).exp_kernels()
    lib = kernels.exp_library(isa)
    assert lib is not None, f"exp_blocks.c did not build for {isa}"
    return ExpKernels(lib.sluice_exp_blocks, lib.sluice_exp_block)


needs_kernel = pytest.mark.skipif(not _ISA <= kernel_build.cpu_flags(), reason="this CPU lacks AVX512-BF16")
needs_avx512 = pytest.mark.skipif(not {"avx512f", "avx512bw"} <= kernel_build.cpu_flags(), reason="no AVX-512")
needs_avx2 = pytest.mark.skipif(not {"avx2", "fma"} <= kernel_build.cpu_flags(), reason="this CPU lacks AVX2/FMA")
# the exp pass's builds (csrc/f32_vec.h's vectors): each test of them runs on every one this CPU has, each at
# half the examples the AVX-512 build alone had (the suite's time)
EXP_ISAS = [pytest.param(kernel_build._AVX512, id="AVX-512F", marks=needs_avx512),
            pytest.param(kernel_build._AVX2, id="AVX2", marks=needs_avx2)]


@pytest.fixture
def fresh_kernels(tmp_path, monkeypatch):
    """A cache directory of its own and no kernel loaded yet."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    kernel_build.clear()
    yield
    kernel_build.clear()


_ONE_GOMP = """
import torch
from sluice.engine.lm_head import lm_head
head = lm_head(torch.randn(100, 32).bfloat16())
assert head.kernel is not None, "the kernel failed to build (see the sluice.engine log)"
print(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}))
"""


@needs_kernel
def test_kernel_builds_where_the_cpu_has_avx512_bf16():
    """In a process that loads what the engine loads (torch, then the kernel): one OpenMP runtime. (Not this
    test process: a test's own imports, e.g. sentencepiece through transformers, bring libgomps of their own.)"""
    done = subprocess.run([sys.executable, "-c", _ONE_GOMP], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    gomps = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(gomps) == 1, f"one OpenMP runtime for torch and the kernel, not {gomps}"


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 700), dim=st.sampled_from([2, 32, 64, 130]), rows=st.integers(1, 40),
       ties=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_kernel_logits_are_f_linear_and_its_argmax_theirs(vocab, dim, rows, ties, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=g).bfloat16()
    hidden = torch.randn(rows, dim, generator=g).bfloat16()
    for i in range(min(ties, vocab - 1)):  # equal rows give equal logits: the first index must win
        weight[vocab - 1 - i] = weight[i]
        hidden[i % rows] = weight[i] * 4
    head = lm_head(weight)
    assert head.kernel is not None
    logits = head(hidden)
    assert logits.dtype == torch.bfloat16 and logits.shape == (rows, vocab)
    torch.testing.assert_close(logits.float(), F.linear(hidden.float(), weight.float()), rtol=1e-2, atol=1e-2)
    tokens = head.argmax(hidden)
    assert torch.equal(tokens, argmax(logits))
    alone = torch.cat([head.argmax(hidden[r : r + 1]) for r in range(rows)])
    assert torch.equal(tokens, alone)
    assert torch.equal(head(hidden[:1]), logits[:1])


@needs_kernel
def test_kernel_over_the_o200k_vocabulary_matches_onednn_argmax():
    torch.manual_seed(0)
    weight = (torch.randn(201_088, 128) * 0.5).bfloat16()
    hidden = torch.randn(24, 128).bfloat16()
    head = lm_head(weight)
    ref = torch.ops.mkldnn._linear_pointwise(hidden, torch.ops.mkldnn._reorder_linear_weight(weight), None,
                                            "none", [], "")
    torch.testing.assert_close(head(hidden).float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(head.argmax(hidden), argmax(head(hidden)))


needs_vnni = pytest.mark.skipif(not _ISA | {"avx512_vnni"} <= kernel_build.cpu_flags(),
                                reason="this CPU lacks AVX512-BF16 or AVX512-VNNI")


def _near_ties(weight: torch.Tensor, hidden: torch.Tensor, ties: int, g: torch.Generator) -> None:
    """Makes rows' top logits close: copies of a row (exact ties: the first index must win), copies one bf16
    step off in one column, and hidden rows along a weight row (its logit then tops the rest by a margin
    that the int8 screen cannot resolve alone)."""
    vocab, rows = len(weight), len(hidden)
    for i in range(min(ties, vocab // 2)):
        j = int(torch.randint(vocab, (1,), generator=g))
        weight[vocab - 1 - i] = weight[j]
        if i % 2:
            col = int(torch.randint(weight.shape[1], (1,), generator=g))
            weight[vocab - 1 - i, col] = torch.nextafter(weight[j, col].float(), torch.tensor(9.0)).bfloat16()
        hidden[i % rows] = weight[j] * 3


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 3000), dim=st.sampled_from([4, 32, 128, 260]), rows=st.integers(1, 40),
       ties=st.integers(0, 8), cluster=st.integers(0, 60), along=st.booleans(),
       eps=st.sampled_from([0.01, 0.1, 1.0]), outlier=st.booleans(), spread=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_screened_argmax_is_the_bf16_kernels(vocab, dim, rows, ties, cluster, along, eps, outlier, spread, seed):
    """The screen settles every row on the bf16 kernel's token: random rows; near and exact ties; a cluster
    of large rows around one direction, with hidden rows along it (top logits large and close: bf16
    rounding ties) or across it (top logits as close as the int8 error of the large common part); a hidden
    outlier column (coarse activation quantization); vocabulary rows of very different sizes."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=g)
    if spread:
        weight *= torch.exp(torch.randn(vocab, 1, generator=g) * 2)
    hidden = torch.randn(rows, dim, generator=g)
    cluster = min(cluster, vocab)
    if cluster:
        base = torch.randn(dim, generator=g) * 3
        weight[:-cluster] *= 0.01
        weight[-cluster:] = base + eps * torch.randn(cluster, dim, generator=g)
        if along:
            hidden = base + eps * hidden
        else:
            hidden -= (hidden @ base)[:, None] * base / (base @ base)
    weight, hidden = weight.bfloat16(), hidden.bfloat16()
    _near_ties(weight, hidden, ties, g)
    if outlier:
        hidden[:, 0] = 60
    kernel = Bf16Matmul.build(weight)
    screen = Int8Argmax.build(kernel, weight)
    assert screen is not None
    assert torch.equal(screen(hidden), kernel.argmax(hidden))
    assert screen.rows == rows


@needs_vnni
def test_int8_screen_keeps_a_column_whose_int8_error_is_its_whole_bound():
    """Column 3's values sit halfway between int8 steps and the hidden row takes every error's sign, so its
    screened logit is short of its true one by the whole of its error bound; column 7 (exact in int8)
    lies just below it in truth (by less than a tenth of that bound) and far above it screened. The token
    is column 3: a bound 15% short would lose it."""
    g = torch.Generator().manual_seed(0)
    k, step = 128, 2.0**-6
    n = -torch.randint(0, 2, (k,), generator=g)  # values (n + 1/2) step: n = 0 rounds down, -1 up (to even)
    x = torch.where(n == 0, 1.0, -1.0)  # the sign of each value's rounding error
    w3 = (n + 0.5) * step
    w3[0], x[0] = 127 * step, 1.0  # the row's largest value: its scale is `step`, exactly
    w7 = torch.round(w3 / step) * step
    w7[1:60] += step * x[1:60]  # 59 of the 63.5 steps the screen loses on column 3, back
    weight = torch.randn(500, k, generator=g) * 1e-3
    weight[3], weight[7] = w3, w7
    weight, hidden = weight.bfloat16(), x[None].bfloat16()
    true = weight.float() @ x
    assert 0.07 < (true[3] - true[7]).item() < 0.08
    kernel = Bf16Matmul.build(weight)
    screen = Int8Argmax.build(kernel, weight)
    assert kernel.argmax(hidden).item() == 3 and screen(hidden).item() == 3 and screen.redone == 0


@needs_vnni
def test_int8_screen_keeps_the_columns_that_round_to_the_top_in_bf16():
    """Integer weights and hidden rows whose largest values are 127 quantize exactly: the screen's only
    slack is the bf16 rounding of the logits, under which near-copies of one row (logits ~170k, a bf16
    step of 1024) tie and the first index wins, whichever is largest in float32."""
    g = torch.Generator().manual_seed(1)
    k = 32
    weight = torch.randint(-127, 128, (3000, k), generator=g).float()
    family = weight[10] + torch.randint(-2, 3, (10, k), generator=g) * (torch.rand(10, k, generator=g) < 0.1)
    weight[:10] = family.clamp(-127, 127)
    hidden = (weight[10] + torch.randint(-3, 4, (40, k), generator=g)).clamp(-127, 127)
    weight[:, 0] = hidden[:, 0] = 127
    weight, hidden = weight.bfloat16(), hidden.bfloat16()
    logits = weight.float() @ hidden.float().T
    kernel = Bf16Matmul.build(weight)
    tokens = kernel.argmax(hidden)
    assert (tokens != logits.argmax(dim=0)).sum() >= 5  # the bf16 ties matter in these rows
    screen = Int8Argmax.build(kernel, weight)
    assert torch.equal(screen(hidden), tokens) and screen.redone == 0


@needs_vnni
def test_int8_screen_redoes_rows_it_cannot_narrow_and_stops_where_that_is_common(monkeypatch, caplog):
    """Hundreds of equal top logits overflow the screen's pools: those rows are computed again in full
    (the same tokens, the first index of the tie); all-zero rows cannot be quantized and are too. A head
    whose rows are mostly redone stops screening."""
    weight = torch.randn(4000, 64).bfloat16()
    weight[1000:1600] = weight[999]  # 601 equal rows
    hidden = torch.randn(8, 64).bfloat16()
    hidden[:3] = weight[999] * 2
    hidden[5] = 0
    head = lm_head(weight)
    assert head.screen is not None
    tokens = head.argmax(hidden)
    assert torch.equal(tokens, head.kernel.argmax(hidden))
    assert tokens[:3].tolist() == [999] * 3 and tokens[5] == 0
    assert head.screen.redone == 4 and head.screen.active
    monkeypatch.setattr(Int8Argmax, "_TRIAL", 16)
    with caplog.at_level("INFO", logger="sluice.engine"):
        head.argmax(hidden)
    assert head.screen.redone == 8 and head.screen.rows == 16 and not head.screen.active
    assert "no longer screened" in caplog.text
    calls = []
    monkeypatch.setattr(head.screen, "fn", lambda *a: calls.append(a))
    assert torch.equal(head.argmax(hidden), tokens) and not calls  # the bf16 kernel alone now


def test_disabled_kernels_fall_back_to_onednn(fresh_kernels, monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    weight, hidden = torch.randn(300, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    head = lm_head(weight)
    assert head.kernel is None
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), rtol=1e-2, atol=1e-2)
    assert torch.equal(head.argmax(hidden), argmax(head(hidden)))
    probs, sums = exp_blocks(head(hidden), torch.ones(5, 1), _exp())
    assert sums is None
    torch.testing.assert_close(probs, torch.softmax(head(hidden).float(), dim=-1))


@needs_kernel
def test_a_failed_build_falls_back_and_says_why(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("WARNING", logger="sluice.engine"):
        head = lm_head(torch.randn(300, 32).bfloat16())
    assert head.kernel is None and head.onednn is not None
    assert "build failed" in caplog.text


def test_bf16_engine_greedy_tokens_are_those_of_the_logits_path(tiny_chat_dir):
    """A step whose rows are all plain greedy takes the argmax-only path; asking for logprobs forces the
    logits path: the tokens are the same."""
    prompts = [[5, 17, 300, 42], [7, 7, 7], list(range(40, 70)), [100, 2, 3, 99, 12]]
    runner, sched = make_engine(tiny_chat_dir, dtype=torch.bfloat16)
    assert (runner.lm_head.kernel is not None) == (_ISA <= kernel_build.cpu_flags())
    calls = []
    argmax_only = runner.lm_head.argmax
    runner.lm_head.argmax = lambda hidden: calls.append(len(hidden)) or argmax_only(hidden)
    fused = generate(runner, sched, [seq(f"f{i}", p, max_tokens=12, temperature=0) for i, p in enumerate(prompts)])
    runner, sched = make_engine(tiny_chat_dir, dtype=torch.bfloat16)
    with_logits = generate(runner, sched, [seq(f"f{i}", p, max_tokens=12, temperature=0, logprobs=0)
                                           for i, p in enumerate(prompts)])
    assert calls and sum(calls) >= 4 * 10  # the decode steps took the argmax-only path
    assert fused == with_logits


@needs_kernel
def test_greedy_rows_beside_sampled_ones_take_the_argmax_path_with_the_same_tokens(tiny_chat_dir):
    """Five greedy requests beside three seeded sampled ones (one with logprobs): the greedy rows' argmax
    runs apart, without logits, and every request gets the tokens it gets alone."""
    prompts = [[5, 17, 300, 42], [7, 7, 7], list(range(40, 70)), [100, 2, 3, 99, 12], [8, 9], [1, 2, 3],
               [60, 61], list(range(200, 230))]

    def requests(which):
        return [seq(f"r{i}", p, max_tokens=10, seed=i, **({"temperature": 0} if i < 5 else
                                                          {"temperature": 1.0, "logprobs": 2 if i == 7 else None}))
                for i, p in enumerate(prompts) if i in which]

    runner, sched = make_engine(tiny_chat_dir, dtype=torch.bfloat16)
    rows, steps = [], []
    argmax_only, run = runner.lm_head.argmax, runner.run
    runner.lm_head.argmax = lambda hidden: rows.append(len(hidden)) or argmax_only(hidden)
    runner.run = lambda batch: steps.append((list(batch.seqs), run(batch))) or steps[-1][1]
    together = generate(runner, sched, requests(range(8)))
    assert rows.count(5) >= 8  # the decode steps split the five greedy rows off
    split = [(seqs, out) for seqs, out in steps if len(seqs) == 8 and len(out.tokens) == 8]
    assert split
    for seqs, out in split:  # the logprobs land on the row that asked for them
        assert [e is not None for e in out.logprobs] == [s.request_id == "r7" for s in seqs]
        assert all(len(e.top_ids) == 2 for e in out.logprobs if e is not None)
    alone = {}
    for which in (range(5), range(5, 8)):
        alone |= generate(*make_engine(tiny_chat_dir, dtype=torch.bfloat16), requests(which))
    assert together == alone


@pytest.mark.parametrize("isa", EXP_ISAS)
@settings(max_examples=15, deadline=None)
@given(vocab=st.integers(1, 3000), rows=st.integers(1, 9), masked=st.integers(0, 50),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_exp_blocks_are_torch_exp_and_block_sums(isa, vocab, rows, masked, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 8).to(dtype)
    logits.view(-1)[torch.randint(0, rows * vocab, (masked,), generator=g)] = float("-inf")
    logits[:, 0] = 1.0  # no row entirely masked
    temperature = torch.rand(rows, 1, generator=g) * 2 + 0.05
    probs, sums = exp_blocks(logits, temperature, _exp(isa))
    assert sums is not None, "the kernel did not load"
    x = logits.double() / temperature.double()
    y = x - x.amax(dim=-1, keepdim=True)  # exact here; in float32 it carries ~|y| ulps of rounding
    ref = torch.exp(y)
    tiny = ref < 1e-37  # the kernel flushes what would be subnormal to 0
    err = (probs.double() - ref).abs() / ref
    assert (err[~tiny] <= 4e-7 * (1 + y.abs()[~tiny])).all()
    assert (probs[tiny] <= ref[tiny] + 1e-37).all() and (probs[logits == float("-inf")] == 0).all()
    torch.testing.assert_close(sums, _per_block(probs, torch.sum)[0], rtol=1e-5, atol=1e-30)
    for r in range(rows):  # a row alone gives the same bits
        alone, alone_sums = exp_blocks(logits[r : r + 1], temperature[r : r + 1], _exp(isa))
        assert torch.equal(alone[0], probs[r]) and torch.equal(alone_sums[0], sums[r])


@pytest.mark.parametrize("isa", EXP_ISAS)
@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(1, 5000), rows=st.integers(1, 12), masked=st.integers(0, 3000), peaked=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_drawing_from_block_sums_is_drawing_from_the_written_probs(isa, vocab, rows, masked, peaked, dtype, seed):
    """The sampler's plain-temperature path (the kernel's block sums, then one block's probs a row) draws
    the tokens of the inverse CDF over every prob written, for any uniform: the same bits."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * (20 if peaked else 3)).to(dtype)
    logits.view(-1)[torch.randint(0, rows * vocab, (masked,), generator=g)] = float("-inf")
    logits[:, -1] = 1.0  # no row entirely masked
    temperature = torch.rand(rows, 1, generator=g) * 2 + 0.05
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[0] = 1 - 2**-53  # the last token with mass
    if rows > 1:
        u[1] = 0.0
    tokens = _draw_from_sums(logits, temperature, u, _exp(isa))
    assert tokens is not None, "the kernel did not load"
    probs, sums = exp_blocks(logits, temperature, _exp(isa))
    assert torch.equal(tokens, inverse_cdf(probs, u.float(), sums))


@needs_avx512
def test_sampling_with_the_exp_kernel_draws_torch_softmax_tokens(fresh_kernels, monkeypatch):
    """Seeded rows over the o200k vocabulary draw the same tokens through the kernel as through torch's
    softmax, but where a uniform falls within float32 rounding of a token's boundary."""
    torch.manual_seed(0)
    rows = 64
    logits = (torch.randn(rows, 201_088) * 4).bfloat16()

    class Params:
        temperature, top_p, top_k, min_p = 0.8, 1.0, 0, 0.0

    def batch(exp):
        return SamplingBatch.build([Params] * rows, list(range(rows)), [3] * rows, torch.device("cpu"), exp=exp)

    assert (exp := _exp()) is not None
    fast = sample(logits, batch(exp))
    plain = sample(logits, batch(None))
    assert (fast == plain).sum() >= rows - 1


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_small_bf16_linears_run_on_the_kernel_with_f_linears_values(rows, out_features, bias, seed):
    torch.manual_seed(seed)
    layer = Linear(64, out_features, bias=bias).bfloat16()
    x, weight = torch.randn(rows, 64).bfloat16(), layer.weight.detach().clone()
    CpuBackend(torch.bfloat16).prepare(layer, [])
    out = layer(x)
    assert isinstance(layer.run, Bf16Matmul)
    assert layer.weight.numel() == 0 and torch.equal(layer.run.rows(torch.arange(out_features)), weight)  # (once)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    ref = F.linear(x.float(), weight.float(), None if layer.bias is None else layer.bias.float())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 9), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3, 4, 6, 8]),
       dim=st.sampled_from([16, 32, 48, 64, 80, 128, 256]), keys=st.integers(1, 100), sinks=st.booleans(),
       seed=st.integers(0, 2**16))
def test_decode_attention_kernel_is_the_torch_path(batch, kv_heads, group, dim, keys, sinks, seed):
    from sluice.engine.attention import _attention

    g = torch.Generator().manual_seed(seed)
    heads, num_slots, t = kv_heads * group, 200, batch + 3
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=g).bfloat16()
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(t, heads + 2 * kv_heads, dim, generator=g).bfloat16()[:, :heads]  # a view, as in a model
    rows = torch.randperm(t, generator=g)[:batch]
    slots = torch.randint(0, num_slots, (batch, keys), generator=g)
    mask = torch.rand(batch, 1, 1, keys, generator=g) < 0.7
    mask[:, :, :, 0] = True
    sink = torch.randn(heads, generator=g) if sinks else None
    out = torch.zeros(t + 1, heads, dim, dtype=torch.bfloat16)
    assert ops.decode_attention(q, k_cache, v_cache, rows, slots, mask, 0.3, sink, out)
    qg = q[rows].unsqueeze(1).transpose(1, 2)  # [B, H, 1, D]
    kg = k_cache[slots].transpose(1, 2)  # [B, Hkv, K, D]
    vg = v_cache[slots].transpose(1, 2)
    ref = _attention(qg, kg, vg, mask, 0.3, sink).transpose(1, 2)[:, 0]  # [B, H, D]
    torch.testing.assert_close(out[rows].float(), ref.float(), rtol=2e-2, atol=2e-2)
    untouched = torch.ones(t + 1, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 0).all()


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), dim=st.integers(1, 300), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_kernel_is_float32_rms_norm_rounded_once(rows, dim, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim + (7 if strided else 0), generator=g) * 3).bfloat16()[:, :dim]
    weight = (torch.randn(dim, generator=g) * 0.5 + 1).bfloat16()
    out = ops.rms_norm(x, weight, 1e-6)
    assert out is not None and out.shape == (rows, dim) and out.dtype == torch.bfloat16
    ref = F.rms_norm(x.float(), (dim,), weight.float(), 1e-6)
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-6)  # within one bf16 rounding


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(0, 40), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3, 4]),
       dim=st.integers(1, 150).map(lambda n: 2 * n), seed=st.integers(0, 2**16))
def test_rope_store_kernel_is_float32_rotary_rounded_once_and_the_cache_writes(tokens, kv_heads, group, dim, seed):
    from sluice.engine.attention import rope_and_store
    from sluice.engine.rope import Rotary

    g = torch.Generator().manual_seed(seed)
    heads, num_slots = kv_heads * group, 64
    rotary = Rotary(dim, 100, 10000.0, {"rope_type": "default"})
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).bfloat16()  # q, k, v heads of each row
    positions = torch.randint(0, 100, (tokens,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    k_cache = torch.zeros(num_slots, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros(num_slots, kv_heads, dim, dtype=torch.bfloat16)
    q = ops.rope_store(qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], heads, positions, rotary.cos,
                               rotary.sin, slots, k_cache, v_cache)
    assert q is not None and q.shape == (tokens, heads, dim)
    ref = rotary(qkv[:, : heads + kv_heads].float(), positions)  # float32 rotary, rounded once below
    torch.testing.assert_close(q.float(), ref[:, :heads], rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(k_cache[slots].float(), ref[:, heads:], rtol=2**-7, atol=1e-6)
    assert torch.equal(v_cache[slots], qkv[:, heads + kv_heads :])
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()
    # the layers' torch path (each product rounded to bf16) writes the same slots, with values a rounding or two off
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q2 = rope_and_store(qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :], heads, rotary, positions, k2, v2, slots)
    torch.testing.assert_close(q2.float(), q.float(), rtol=2**-6, atol=5e-2)
    torch.testing.assert_close(k2.float(), k_cache.float(), rtol=2**-6, atol=5e-2)
    assert torch.equal(v2, v_cache)


@needs_kernel
def test_rope_store_kernel_refuses_positions_and_slots_out_of_range():
    from sluice.engine.rope import Rotary

    rotary = Rotary(8, 10, 10000.0, {"rope_type": "default"})
    qkv = torch.randn(2, 3, 8).bfloat16()
    k_cache, v_cache = torch.zeros(4, 1, 8, dtype=torch.bfloat16), torch.zeros(4, 1, 8, dtype=torch.bfloat16)
    for positions, slots in ((torch.tensor([1, 10]), torch.tensor([0, 1])),
                             (torch.tensor([1, 2]), torch.tensor([0, 4])),
                             (torch.tensor([-1, 2]), torch.tensor([0, 1]))):
        with pytest.raises(IndexError):
            ops.rope_store(qkv[:, :2], qkv[:, 2:], 1, positions, rotary.cos, rotary.sin, slots, k_cache,
                                   v_cache)
    assert (k_cache == 0).all() and (v_cache == 0).all()
