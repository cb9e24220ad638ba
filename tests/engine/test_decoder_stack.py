"""A bf16 step through every layer in one kernel call (engine/csrc/decoder_layers.c) against the layers
run op by op. Decode steps: the same hidden states and the same keys and values in the cache (bar a rare
rounding of the SwiGLU's exp), for every Llama-family shape it takes. Steps with prefill chunks: the same
within bf16 rounding (torch's attention rounds its own way). The models and steps it does not take run op
by op."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from sluice.app.builtin_models import write_llama_family
from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu.stack import DecoderStack
from tests.engine.helpers import make_engine, seq

_ISA = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
pytestmark = pytest.mark.skipif(not _ISA <= kernel_build.cpu_flags(), reason="this CPU lacks AVX512-BF16")

VARIANTS = {
    "llama-gqa": dict(architecture="LlamaForCausalLM", tie_word_embeddings=False),
    "qwen2-bias-one-kv-head": dict(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=1, head_dim=32,
                                   intermediate_size=88),
    "mistral-window-12": dict(architecture="MistralForCausalLM", sliding_window=12, num_kv_heads=4,
                              head_dim=48, hidden_size=96, intermediate_size=200),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3, list(range(100, 171, 2))]


def _decoding(path, prompts=PROMPTS):
    """An engine in bf16 whose sequences have all finished their prompts, and its next (all-decode) batch."""
    runner, sched = make_engine(path, block_size=8, dtype=torch.bfloat16)
    for i, p in enumerate(prompts):
        sched.add(seq(f"r{i}", p, max_tokens=50, temperature=0.0))
    for _ in range(4):
        batch = sched.schedule()
        sched.update(batch, runner.run(batch).tokens)
    batch = sched.schedule()
    assert set(batch.num_new_tokens) == {1}
    return runner, batch


def _step(runner, batch, fused: bool):
    """(hidden states, the caches after the step), the caches put back as they were."""
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    calls = mock.patch.object(DecoderStack, "__call__", autospec=True, side_effect=DecoderStack.__call__)
    backbone = runner.model.model
    stack, backbone.stack = backbone.stack, backbone.stack if fused else None
    try:
        with torch.inference_mode(), calls as spy:
            hidden, _ = runner._hidden(batch)
    finally:
        backbone.stack = stack
    assert spy.called == fused
    after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)
    return hidden, after


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert (a == b).float().mean() > 0.95, "more than a rare rounding apart"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_decode_step_in_one_call_is_the_layers_op_by_op(variant, tmp_path):
    path = write_llama_family(tmp_path / variant, **VARIANTS[variant])
    runner, batch = _decoding(path)
    hidden, caches = _step(runner, batch, fused=True)
    ref, ref_caches = _step(runner, batch, fused=False)
    _assert_same(hidden, ref)
    for (k, v), (rk, rv) in zip(caches, ref_caches):
        _assert_same(k, rk)
        _assert_same(v, rv)


def test_the_stack_prepared_again_runs_a_weight_loaded_in_place(tmp_path):
    path = write_llama_family(tmp_path / "m", architecture="LlamaForCausalLM")
    runner, batch = _decoding(path)
    before, _ = _step(runner, batch, fused=True)
    down = runner.model.model.layers[1].mlp.down_proj  # (held packed: a new weight, then prepare again)
    down.weight = nn.Parameter(down.run.rows(torch.arange(down.run.n)) * -3, requires_grad=False)
    assert runner.backend.prepare(runner.model, runner.kv_caches)
    hidden, _ = _step(runner, batch, fused=True)
    ref, _ = _step(runner, batch, fused=False)
    assert not torch.equal(hidden, before)
    _assert_same(hidden, ref)


def test_a_position_beyond_the_rotary_table_raises_with_the_cache_untouched(tmp_path):
    path = write_llama_family(tmp_path / "m", architecture="LlamaForCausalLM", max_position_embeddings=64)
    runner, batch = _decoding(path)
    inputs = runner._prepare(batch)
    saved = [k.clone() for k, _ in runner.kv_caches]
    with torch.inference_mode(), pytest.raises(IndexError):
        runner.model(inputs.input_ids, inputs.positions + 64, runner.kv_caches, inputs.meta,
                     inputs.logits_index)
    assert all(torch.equal(k, k0) for (k, _), k0 in zip(runner.kv_caches, saved))


def test_steps_with_prefill_chunks_in_one_call_are_the_layers_op_by_op(tmp_path):
    """A chunk's rows attend as decodes of their positions (causal within the chunk, over the prefix the
    chunks before it cached, within the window): the op-by-op path's hidden states and cache within bf16
    rounding (torch's attention rounds differently)."""
    path = write_llama_family(tmp_path / "m", **VARIANTS["mistral-window-12"])
    runner, sched = make_engine(path, block_size=8, dtype=torch.bfloat16, budget=19)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add(seq(f"r{i}", p, max_tokens=50, temperature=0.0))
    while max((batch := sched.schedule()).num_new_tokens) > 1:
        sched.update(batch, runner.run(batch).tokens)
    sched.update(batch, runner.run(batch).tokens)
    sched.add(seq("long", list(range(400, 440)), max_tokens=5, temperature=0.0))
    mixed = 0
    for _ in range(4):
        batch = sched.schedule()
        if max(batch.num_new_tokens) > 1:
            mixed += 1
            hidden, caches = _step(runner, batch, fused=True)
            ref, ref_caches = _step(runner, batch, fused=False)
            for a, b in [(hidden, ref), *((x, y) for kv, rkv in zip(caches, ref_caches) for x, y in zip(kv, rkv))]:
                torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
        sched.update(batch, runner.run(batch).tokens)
    assert mixed >= 2  # 3 decodes + 16 of the prompt's tokens, then + 16 more over the cached prefix


def test_q_k_norms_and_long_prefills_run_op_by_op(tmp_path):
    path = write_llama_family(tmp_path / "m", architecture="Qwen3ForCausalLM")
    runner, batch = _decoding(path)
    with mock.patch.object(DecoderStack, "__call__") as fused, torch.inference_mode():
        runner._hidden(batch)
    assert not fused.called and runner.model.model.stack is None  # (Qwen3's q/k norms: the float32 stack's alone)

    path = write_llama_family(tmp_path / "llama", architecture="LlamaForCausalLM")
    runner, batch = _decoding(path)
    runner.run(batch)  # the decode step built the stack
    _, sched = make_engine(path, block_size=8, dtype=torch.bfloat16, budget=4096)
    sched.add(seq("long", list(range(1, 300)), max_tokens=2))  # [299 rows, 304 keys]: past _ROW_KEYS_MAX
    with mock.patch.object(DecoderStack, "__call__") as fused, torch.inference_mode():
        runner.run(sched.schedule())
    assert not fused.called
