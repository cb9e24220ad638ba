"""A CPU with AVX2 and FMA but no AVX-512 (every avx512* and amx flag hidden with SLUICE_CPU_HIDE, on a host
that has them) runs a float32 step through the layers in one call, on csrc/f32_layers.c built for AVX2 (its
linears csrc/f32_matmul_avx2.c's): the path taken is that build's, and its values are torch's float32 path's
within float32 rounding (hidden states, cache, logits), with the same greedy tokens, batched and alone,
decode steps and steps that carry prefill chunks, grouped-query heads, Qwen3's q/k norms, biases, a sliding
window and attention sinks. Prompts too long for the step in one call attend on csrc/causal_attention.c built for
AVX2 (torch's values, the same tokens), with their SwiGLU on f32_layers.c's; the sampler's exp pass runs
csrc/exp_blocks.c's AVX2 build, and the LM head's greedy rows are screened on csrc/f32_int8_argmax.c's AVX2 build
(VPMADDUBSW): the plain argmax's tokens."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu import kernels, ops
from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.cpu.stack import DecoderStack
from sluice.engine.lm_head import lm_head
from tests.engine import test_f32_kernels as f32_tests
from tests.engine.helpers import seq
from tests.engine.test_f32_kernels import (PROMPTS, VARIANTS, _bf16_checkpoint, _close, _engines, decode_step_is_torchs,
                                           screen_case)

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernel_build.cpu_flags(), reason="this CPU lacks AVX2/FMA")


@pytest.fixture(autouse=True)
def avx2_only(monkeypatch):
    """This CPU as one without AVX-512 or AMX, its kernels loaded afresh."""
    wide = sorted(f for f in kernel_build.cpu_flags() if f.startswith(("avx512", "amx")))
    monkeypatch.setenv("SLUICE_CPU_HIDE", ",".join(filter(None, [os.environ.get("SLUICE_CPU_HIDE"), *wide])))
    kernel_build.clear()
    yield
    monkeypatch.undo()
    kernel_build.clear()


def _assert_avx2_step(runner) -> None:
    """The engine runs its layers in one call on f32_layers.c's AVX2 build, its linears on the AVX2 kernel."""
    assert kernels.f32_layers() is None and kernels.f32_step() is kernels.f32_layers_avx2() is not None
    assert runner.one_call and runner.model.model.stack.stack.fn == kernels.f32_layers_avx2().sluice_f32_layers
    linears = [m.run for m in runner.model.modules() if hasattr(m, "run")]
    assert linears and all(isinstance(k, F32Matmul) and k.isa == "AVX2" for k in linears)
    assert runner.lm_head.kernel.isa == "AVX2"
    assert runner.lm_head.screen.fn is kernels.f32_int8_library(kernel_build._AVX2).sluice_f32_int8_argmax


def _one_call_spy(calls: list):
    """A spy on DecoderStack.__call__ that records (rows, whether the step ran in one call)."""
    run = DecoderStack.__call__

    def spy(stack, x, *args):
        ran = run(stack, x, *args)
        calls.append((len(x), ran))
        return ran

    return mock.patch.object(DecoderStack, "__call__", autospec=True, side_effect=spy)


def _lockstep(fast, plain, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Both engines over the same requests, step by step: every step's logits within float32 rounding of
    torch's, every greedy token the same. Returns the tokens."""
    (runner, sched), (ref, ref_sched) = fast, plain
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        sched.add(seq(f"r{i}", p, max_tokens=max_tokens, temperature=0.0))
        ref_sched.add(seq(f"r{i}", p, max_tokens=max_tokens, temperature=0.0))
    while (batch := sched.schedule()) is not None:
        ref_batch = ref_sched.schedule()
        assert ref_batch is not None and ref_batch.num_new_tokens == batch.num_new_tokens
        logits, rows = runner.forward(batch)
        ref_logits, _ = ref.forward(ref_batch)
        _close(logits, ref_logits)
        tokens = logits.argmax(-1).tolist()
        assert ref_logits.argmax(-1).tolist() == tokens
        for s, token in sched.update(batch, tokens).new_tokens:
            out.setdefault(s.request_id, []).append(token)
        ref_sched.update(ref_batch, tokens)
    assert ref_sched.schedule() is None
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_avx2_decode_step_in_one_call_is_torchs(variant, tmp_path):
    _assert_avx2_step(decode_step_is_torchs(_bf16_checkpoint(tmp_path / variant, **VARIANTS[variant])))


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qk-norm"])
def test_avx2_steps_batched_and_alone_give_torchs_logits_and_tokens(variant, tmp_path):
    path = _bf16_checkpoint(tmp_path / variant, **VARIANTS[variant])
    calls: list = []
    with _one_call_spy(calls):
        batched = _lockstep(*_engines(path, block_size=8), PROMPTS, max_tokens=12)
        alone = {}
        for i, p in enumerate(PROMPTS):
            alone[f"r{i}"] = _lockstep(*_engines(path, block_size=8), [p], max_tokens=12)["r0"]
    assert batched == alone
    assert calls and all(ran for _, ran in calls)
    assert {len(PROMPTS), 1} <= {rows for rows, _ in calls}  # the batch's decodes, and each one's alone


def test_avx2_steps_with_prefill_chunks_in_one_call_are_torchs(tmp_path):
    """A chunk's rows attend as decodes of their positions (causal, within the window)."""
    path = _bf16_checkpoint(tmp_path / "m", **VARIANTS["mistral-window-12"])
    calls: list = []
    with _one_call_spy(calls):
        _lockstep(*_engines(path, block_size=8, budget=19), [*PROMPTS[:3], list(range(400, 440))], max_tokens=20)
    assert all(ran for _, ran in calls)
    assert sum(rows > 4 for rows, _ in calls) >= 2  # steps whose rows include a prompt's chunk (19-token budget)


def test_avx2_steps_with_attention_sinks_are_torchs(tmp_path):
    """Learned sink logits (gpt-oss's), set on a Llama's layers: the stack reads them as torch's path does."""
    path = _bf16_checkpoint(tmp_path / "m", **VARIANTS["llama-gqa"])
    fast, plain = _engines(path, block_size=8, budget=16)
    g = torch.Generator().manual_seed(0)
    for layer_fast, layer_plain in zip(fast[0].model.model.layers, plain[0].model.model.layers):
        sinks = torch.randn(layer_fast.self_attn.heads[0], generator=g) * 2
        layer_fast.self_attn.sinks = nn.Parameter(sinks.clone(), requires_grad=False)
        layer_plain.self_attn.sinks = nn.Parameter(sinks.clone(), requires_grad=False)
    assert fast[0].backend.prepare(fast[0].model, fast[0].kv_caches)
    assert all(layer.sinks is not None for layer in fast[0].model.model.stack.stack._layers)
    calls: list = []
    with _one_call_spy(calls):
        _lockstep(fast, plain, PROMPTS, max_tokens=10)
    assert calls and all(ran for _, ran in calls) and any(rows > len(PROMPTS) for rows, _ in calls)


def test_prompts_attention_and_the_exp_pass_take_their_avx2_builds(caplog):
    with caplog.at_level("INFO", logger="sluice.engine"):
        causal, exp = kernels.causal_library(), kernels.exp_library()
    assert causal is kernels.causal_library(kernel_build._AVX2) is not None
    assert exp is kernels.exp_library(kernel_build._AVX2) is not None
    assert kernels.causal_attention_f32() is causal.sluice_f32_causal_attention
    assert CpuBackend(torch.float32).exp_kernels() == (exp.sluice_exp_blocks, exp.sluice_exp_block)
    assert "CPU kernel causal_attention: AVX2 and FMA" in caplog.text
    assert "CPU kernel exp_blocks: AVX2 and FMA" in caplog.text


# (chunks (start, length), kv heads, query heads per kv head, head dim, seed): whole prompts and chunks from later
# positions, padded to the longest; tails of the kernel's 64-key blocks and 16-position tiles; every run of
# vectors the AVX2 build's value products take (head dims of 2, 4 + 2 and 4 x 8 vectors); 1 to 16 query heads
# a kv head
_CAUSAL_CASES = [([(0, 150)], 1, 16, 256, 1), ([(37, 90), (0, 5), (150, 61)], 3, 3, 48, 2),
                 ([(5, 70)], 2, 5, 16, 3), ([(64, 64), (1, 1)], 1, 1, 128, 4), ([(0, 1)], 2, 2, 32, 5)]


@pytest.mark.parametrize("chunks, kv_heads, group, dim, seed", _CAUSAL_CASES)
def test_avx2_prompts_attention_is_the_masked_torch_path(chunks, kv_heads, group, dim, seed):
    """test_f32_kernels' test of csrc/causal_attention.c (torch's values within float32 rounding), on its AVX2
    build."""
    assert kernels.causal_attention_f32() is kernels.causal_library(kernel_build._AVX2).sluice_f32_causal_attention
    f32_tests.test_float32_causal_attention_is_the_masked_torch_path.hypothesis.inner_test(
        chunks=chunks, kv_heads=kv_heads, group=group, dim=dim, seed=seed)


@pytest.mark.parametrize("kv", f32_tests.KV_DTYPES)
def test_avx2_paged_prompts_attention_reads_queries_and_keys_where_they_lie(kv):
    """From a float32 cache and from 16-bit ones (F16C's conversions, bf16 widened by a shift)."""
    f32_tests.test_paged_causal_attention_reads_queries_and_keys_where_they_lie.hypothesis.inner_test(
        chunks=[(37, 70), (0, 5), (100, 61)], kv_heads=3, group=3, dim=64, kv=kv, seed=7)


def test_avx2_long_prompts_attend_on_the_causal_kernel_with_torchs_logits_and_tokens(tmp_path):
    """A prompt too long for the step in one call (rows x keys past 65,536), its first chunk from position 0 and
    its second from 260: its attention on causal_attention.c's AVX2 build and its SwiGLU on f32_layers.c's (after
    the gate-and-up product: no fused epilogue on AVX2), every step's logits torch's within float32 rounding and
    its greedy tokens."""
    path = _bf16_checkpoint(tmp_path / "m", **VARIANTS["llama-gqa"])
    run, starts, swiglu, fused = ops.paged_causal_attention, [], F32Matmul.swiglu, []

    def spy(*args):
        ran = run(*args)
        starts.append(int(args[7].max()) if ran else -1)
        return ran

    def swiglu_spy(kernel, x):
        fused.append(kernel.swiglu_fused)
        return swiglu(kernel, x)

    with mock.patch.object(ops, "paged_causal_attention", side_effect=spy), \
            mock.patch.object(F32Matmul, "swiglu", autospec=True, side_effect=swiglu_spy):
        _lockstep(*_engines(path, block_size=16, num_blocks=128, budget=260),
                  [[(3 * i) % 390 + 5 for i in range(520)]], max_tokens=4)
    assert kernels.causal_attention_f32() is kernels.causal_library(kernel_build._AVX2).sluice_f32_causal_attention
    assert sorted(set(starts)) == [0, 260]  # each layer's attention of both chunks on the kernel
    assert fused and not any(fused)  # each chunk's layers' SwiGLU after the product, on the kernel


def test_avx2_prompts_swiglu_is_torchs_on_f32_layers():
    """A gate-and-up product without the fused epilogue (AVX2's) runs f32_layers.c's SwiGLU over its rows: torch's
    silu(gate) * up of the same product within float32 rounding (tails of 8 lanes; rows split among threads)."""
    assert kernels.f32_swiglu() is kernels.f32_layers_avx2().sluice_f32_swiglu
    g = torch.Generator().manual_seed(0)
    for rows, inter, dim in [(3, 37, 16), (300, 200, 32), (1, 8, 4)]:
        kernel = F32Matmul.build(torch.randn(2 * inter, dim, generator=g))
        assert kernel is not None and kernel.isa == "AVX2" and kernel.swiglu_ok
        x = torch.randn(rows, dim, generator=g) * 3
        gate, up = kernel(x).chunk(2, dim=-1)
        torch.testing.assert_close(kernel.swiglu(x), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_avx2_int8_screen_gives_the_plain_argmax(caplog):
    """csrc/f32_int8_argmax.c built for AVX2 (chosen at run time, and logged) settles every greedy row on the
    first index of the maximum of the head's logits: bf16 and float32 weights, k past and below one 64-byte
    row of the int8 tiles, vocabularies with tails of a tile, near and exact ties, and rows the screen cannot
    narrow (hundreds of equal top logits: computed again in full, and counted)."""
    with caplog.at_level("INFO", logger="sluice.engine"):
        fn = kernels.f32_int8_argmax()
    assert fn is kernels.f32_int8_library(kernel_build._AVX2).sluice_f32_int8_argmax is not None
    assert "CPU kernel f32_int8_argmax: AVX2 (VPMADDUBSW)" in caplog.text
    g = torch.Generator().manual_seed(1)
    screened = redone = 0
    for vocab, dim, rows, ties, cluster, outlier, bf16 in [
            (3001, 128, 23, 6, 0, False, False), (2000, 260, 9, 3, 40, False, True), (17, 4, 5, 2, 0, True, False),
            (1500, 64, 40, 0, 0, True, True), (700, 32, 6, 0, 300, False, False)]:
        weight, hidden = screen_case(vocab, dim, rows, ties, cluster, outlier, g)
        head = lm_head(weight.bfloat16() if bf16 else weight, torch.float32)
        assert head.kernel.isa == "AVX2" and head.screen is not None and head.screen.fn is fn
        logits = head(hidden)
        first_max = (logits == logits.amax(dim=1, keepdim=True)).float().argmax(dim=1)
        tokens = head.screen(hidden)
        assert torch.equal(tokens, first_max) and torch.equal(tokens, head.kernel.argmax(hidden))
        screened, redone = screened + rows, redone + head.screen.redone
    assert 0 < redone < screened / 4  # (the 300-row cluster's rows redone; the others settled by the screen)
