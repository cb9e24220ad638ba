"""The quantized linears (engine/quant.py, engine/cpu/quant.py, csrc/quant_matmul.c and quant_blocks.h), the
quantized embedding and LM head, and the one-call step over quantized layers (csrc/f32_layers.c) against
float32 products of the same weights dequantized by the gguf package (llama.cpp's definitions), on every
instruction set this CPU has (SLUICE_CPU_HIDE hides AVX-512 to run the AVX2 builds)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sluice.engine.backend import TORCH
from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu import quant as cpu_quant
from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.quant import QuantLMHead, QuantMatmul, quant_linear
from sluice.engine.layers import Embedding
from sluice.engine.quant import BY_NAME, QuantizedWeight, dequantized, quantize, set_quantized
from sluice.engine.sampler import argmax

VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= kernel_build.cpu_flags()
AVX2 = {"avx2", "fma"} <= kernel_build.cpu_flags()
ISAS = [pytest.param("AVX512-VNNI", marks=pytest.mark.skipif(not VNNI, reason="this CPU lacks AVX512-VNNI")),
        pytest.param("AVX2", marks=pytest.mark.skipif(not AVX2, reason="this CPU lacks AVX2/FMA"))]
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture
def isa(request, monkeypatch):
    """The kernels built for one instruction set."""
    if request.param == "AVX2":  # (every AVX-512 flag: the one-call step's AVX2 build too; beside a run's own)
        hidden = [os.environ.get("SLUICE_CPU_HIDE"), *(f for f in kernel_build.cpu_flags() if f.startswith("avx512"))]
        monkeypatch.setenv("SLUICE_CPU_HIDE", ",".join(filter(None, hidden)))
    kernel_build.clear()
    assert cpu_quant.library()[1] == request.param
    yield request.param
    kernel_build.clear()


def random_weight(name: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A weight [N, K] of random blocks: random bytes, with each block's float16 scales set to small normal
    values (random bytes there would be infs and NaNs). Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 through gguf's own quantizer, of
    random floats, so their values are those a real file holds."""
    gen = torch.Generator().manual_seed(seed)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return quantize(torch.randn(n, k, generator=gen) * 0.05, name)
    qtype = BY_NAME[name]
    blocks = torch.randint(0, 256, (n, k // qtype.block_size, qtype.block_bytes), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // qtype.block_size, 2, generator=gen) * 1e-3 + 1e-4).half().view(torch.uint8)
    at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[name]
    for i, offset in enumerate(at):
        blocks[..., offset : offset + 2] = scales[..., 2 * i : 2 * i + 2]
    return QuantizedWeight(blocks.reshape(n, -1).contiguous(), qtype, (n, k))


def reference(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.dequantize().double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
def test_the_kernel_dequantizes_every_type_as_the_gguf_package_does(isa, name):
    weight = random_weight(name, 19, 512)
    assert torch.equal(cpu_quant.dequantize(weight), weight.dequantize())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 37, 256), (5, 16, 768), (33, 50, 512), (3, 21, 96)])
def test_float_activations_give_the_float32_product_of_the_dequantized_weight(isa, name, shape):
    m, n, k = shape
    if k % BY_NAME[name].block_size:
        pytest.skip("K is not whole blocks of this type")
    weight = random_weight(name, n, k, seed=m)
    x, bias = torch.randn(m, k), torch.randn(n)
    got = QuantMatmul.build(weight, bias, int8=False)(x)
    want = reference(weight, x, bias)
    scale = x.abs().double() @ weight.dequantize().abs().double().T  # (float32 rounding is relative to this)
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 37, 256), (5, 16, 768), (33, 50, 512), (3, 21, 96)])
def test_int8_activations_give_the_product_within_the_activations_rounding(isa, name, shape):
    """Each block of 32 of x is rounded to 127 levels of its largest magnitude: the error is within half a level
    per value, times the weight's magnitude (and the product is computed exactly from there, up to float32)."""
    m, n, k = shape
    if k % BY_NAME[name].block_size:
        pytest.skip("K is not whole blocks of this type")
    weight = random_weight(name, n, k, seed=m)
    x = torch.randn(m, k)
    got = QuantMatmul.build(weight, None, int8=True)(x)
    w = weight.dequantize().double()
    level = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(m, k).double() / 127
    bound = (level / 2) @ w.abs().T + 1e-5 * (x.abs().double() @ w.abs().T) + 1e-6
    assert ((got.double() - reference(weight, x, None)).abs() <= bound).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
def test_a_rows_product_is_the_same_bits_alone_or_in_any_batch(isa, name):
    """Up to 8 rows the weight is decoded in registers for every few rows, past that once into a buffer the
    rows read: the same values in the same order of sums either way, whatever the tile a row falls in (13
    weight rows: a last tile of one)."""
    weight = random_weight(name, 13, 512)
    kernel = QuantMatmul.build(weight, torch.randn(13), int8=False)
    x = torch.randn(12, 512)
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(12)])
    for m in (2, 3, 5, 8, 9, 12):
        assert torch.equal(kernel(x[:m]), alone[:m])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("int8", [True, False])
def test_a_prompts_rows_go_a_panel_at_a_time_with_the_same_bits(isa, name, int8):
    """300 rows of 512 values are panels of 288 rows (int8) or of 96 (float), each panel's rows against every tile
    before the next panel's, the last panel short: each row's output is the one it has in a batch of 50."""
    weight = random_weight(name, 40, 512)
    kernel = QuantMatmul.build(weight, torch.randn(40), int8=int8)
    x = torch.randn(300, 512)
    assert torch.equal(kernel(x), torch.cat([kernel(x[i : i + 50]) for i in range(0, 300, 50)]))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 4, 11])
def test_parts_of_different_types_run_as_one_stacked_weight(isa, m):
    """A Q4_K_M file's stacked q/k/v: parts of Q4_K, Q6_K and Q8_0 rows (not whole tiles), in one product."""
    parts = (random_weight("Q4_K", 9, 512, 1), random_weight("Q6_K", 6, 512, 2), random_weight("Q8_0", 13, 512, 3))
    x, bias = torch.randn(m, 512), torch.randn(28)
    got = QuantMatmul.build(parts, bias, int8=False)(x).double()
    w = dequantized(parts).double()
    want = x.double() @ w.T + bias.double()
    assert ((got - want).abs() <= 1e-5 * (x.abs().double() @ w.abs().T) + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
def test_a_quantized_embedding_dequantizes_only_the_rows_it_looks_up(isa, name):
    table = random_weight(name, 40, 256)
    for backend in (CpuBackend(torch.float32), TORCH):
        embedding = Embedding(40, 256)
        set_quantized(embedding, (table,))
        embedding.backend = backend
        ids = torch.tensor([[3, 39, 3], [0, 7, 1]])
        assert embedding.weight.numel() == 0
        assert torch.equal(embedding(ids), table.dequantize()[ids])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_quantized_lm_head_multiplies_by_the_table_as_it_lies(isa, name):
    """The CPU's head runs the product over the quantized table (no float32 copy); torch's path dequantizes it:
    the same logits up to float32 sums, the same greedy tokens."""
    table = random_weight(name, 300, 256)
    head = CpuBackend(torch.float32).lm_head(table)
    assert isinstance(head, QuantLMHead) and head.weight.numel() == 0 and head.kernel.isa.startswith(isa)
    hidden = torch.randn(5, 256)
    w = table.dequantize().double()
    scale = hidden.abs().double() @ w.abs().T
    assert ((head(hidden).double() - hidden.double() @ w.T).abs() <= 1e-5 * scale + 1e-6).all()
    torch_head = TORCH.lm_head(table)
    assert torch.equal(torch_head.weight, table.dequantize())
    assert torch.equal(head.argmax(hidden), torch_head.argmax(hidden))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q8_0"])
def test_a_quantized_lm_heads_screened_argmax_is_its_logits_argmax_on_near_ties(isa, name):
    """Greedy rows are screened with int8 activations, then only the candidates' float logits computed: each
    row's token is the first index of the maximum of the full float logits, where rows of the table tie
    exactly (copies) and nearly (one value a step apart), and on a row of zeros (every logit 0)."""
    base = random_weight(name, 64, 128, seed=3)
    rows = torch.arange(64).repeat(4)  # (every row four times: exact ties, first index wins)
    table = QuantizedWeight(base.data[rows].clone(), base.qtype, (256, 128))
    table.data[70, -1] ^= 1  # (a copy a nibble or a step off its original: a near tie)
    head = CpuBackend(torch.float32).lm_head(table)
    assert isinstance(head, QuantLMHead) and head.screen is not None
    hidden = torch.cat([torch.randn(6, 128), torch.zeros(1, 128)])
    assert torch.equal(head.argmax(hidden), argmax(head(hidden)))
    assert head.argmax(hidden)[-1] == 0


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_int8_activations_match_an_int8_reference_bit_for_bit_up_to_float_sums(isa):
    """The int8 path computes llama.cpp's Q8_0 x Q8_0 product: the exact integer dot of each block, scaled."""
    weight = random_weight("Q8_0", 8, 128)
    x = torch.randn(3, 128)
    got = QuantMatmul.build(weight, None, int8=True)(x).double()
    blocks = x.view(3, -1, 32)
    d = blocks.abs().amax(-1) / 127
    xq = torch.round(blocks * torch.where(d > 0, 1 / d, 0)[..., None])
    raw = weight.data.view(8, -1, 34)
    wd = raw[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
    wq = raw[..., 2:].contiguous().view(torch.int8).double()
    dots = torch.einsum("mbi,nbi->mnb", xq.double(), wq)
    want = (dots * d.double()[:, None, :] * wd.double()[None]).sum(-1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_rows_leading_dims_and_bf16_rows_keep_their_shape_and_dtype(isa):
    weight = random_weight("Q4_0", 24, 64)
    kernel = QuantMatmul.build(weight, None, int8=False)
    x = torch.randn(2, 3, 64)
    assert kernel(x).shape == (2, 3, 24)
    assert torch.allclose(kernel(x).view(6, 24), kernel(x.view(6, 64)))
    assert kernel(x.bfloat16()).dtype == torch.bfloat16
    assert kernel(torch.randn(0, 64)).shape == (0, 24)
    strided = torch.randn(4, 128)[:, :64]
    assert torch.allclose(kernel(strided), kernel(strided.contiguous()))


def test_without_kernels_a_quantized_linear_runs_dequantized(monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    kernel_build.clear()
    try:
        weight = random_weight("Q8_0", 8, 64)
        run = quant_linear(weight, None)
        assert not isinstance(run, QuantMatmul)
        x = torch.randn(3, 64)
        assert torch.allclose(run(x), x @ weight.dequantize().T)
    finally:
        kernel_build.clear()


def test_quantize_round_trips_within_half_a_step():
    """Half a step of 127 per block, and the float16 rounding of the step (2^-11 of it, 127 times)."""
    w = torch.randn(16, 64)
    q = quantize(w, "Q8_0")
    step = w.view(16, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert ((q.dequantize().view(16, 2, 32) - w.view(16, 2, 32)).abs() <= step * (0.5 + 127 * 2**-11)).all()
    assert q.nbytes == 16 * 2 * 34
    assert np.dtype(np.uint8) == q.data.numpy().dtype


@pytest.mark.parametrize("choice, qtype", [("int8", "Q8_0"), ("q4", "Q4_0")])
def test_quantization_at_load_quantizes_every_layer_linear_and_the_engine_runs_it(choice, qtype, tmp_path,
                                                                                  monkeypatch):
    """--quantization: each linear of the layers in the block format, the embedding (tied to the LM head) in
    Q8_0; the quantized model's logits of a prompt near the float model's (random weights amplify the
    rounding: Q8_0 moves them by about a percent of their range here, Q4_0 by about ten)."""
    from sluice.app.builtin_models import write_llama_family
    from sluice.engine.layers import Linear
    from sluice.engine.loader import load_model
    from sluice.engine.quant import dequantized
    from tests.engine.helpers import seq

    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")
    kernel_build.clear()
    path = write_llama_family(tmp_path / "m", architecture="Qwen3ForCausalLM", num_shards=1)
    dense = load_model(path, torch.float32, torch.device("cpu"))
    model = load_model(path, torch.float32, torch.device("cpu"), choice)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert linears and all(m.quant[0].qtype.name == qtype and m.weight.numel() == 0 for m in linears.values())
    weights = dict(dense.named_parameters())
    for name, module in linears.items():
        w = weights[f"{name}.weight"]
        # (Q4_0's step is max / 8, its largest magnitude at -8: the other end's rounding may take a whole step)
        step = w.view(w.shape[0], -1, 32).abs().amax(-1).max() / (127 if choice == "int8" else 8)
        assert (dequantized(module.quant) - w).abs().max() <= step * (0.6 if choice == "int8" else 1.0)
    table = model.model.embed_tokens.quant[0]
    assert model.lm_weight() is table and table.qtype.name == "Q8_0" and model.model.embed_tokens.weight.numel() == 0
    assert (table.dequantize() - dense.model.embed_tokens.weight).abs().max() <= (
        dense.model.embed_tokens.weight.abs().max() / 127 * 0.6)
    logits = []
    for m in (dense, model):
        runner, sched = _engine_of(m)
        sched.add(seq("r", [5, 6, 7, 8, 9], max_tokens=1, temperature=0.0))
        logits.append(runner.forward(sched.schedule())[0][0])
    assert ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()) < (0.03 if choice == "int8" else 0.3)
    kernel_build.clear()


def test_the_kv_cache_is_float16_by_default_under_quantized_linears_and_the_activations_dtype_else(tmp_path):
    """--kv-cache-dtype auto: float16 (llama.cpp's cache) where the linears are quantized and the activations
    float32, the activations' dtype otherwise; a dtype named is taken as it is."""
    from sluice.app.builtin_models import write_llama_family
    from sluice.engine.engine import pick_kv_dtype
    from sluice.engine.loader import load_model

    path = write_llama_family(tmp_path / "m", architecture="Qwen3ForCausalLM", num_shards=1)
    dense, quantized = (load_model(path, torch.float32, torch.device("cpu"), q) for q in ("none", "int8"))
    assert pick_kv_dtype("auto", torch.float32, quantized) == torch.float16
    assert pick_kv_dtype("auto", torch.float32, dense) == torch.float32
    assert pick_kv_dtype("auto", torch.bfloat16, dense) == torch.bfloat16
    assert pick_kv_dtype("auto", torch.float32, None) == torch.float32  # (the replay runner: no model)
    assert pick_kv_dtype("float32", torch.float32, quantized) == torch.float32
    assert pick_kv_dtype("bfloat16", torch.float32, dense) == torch.bfloat16
    assert pick_kv_dtype("fp8", torch.float32, quantized) == pick_kv_dtype("fp8_e4m3", torch.float32, dense) \
        == torch.float8_e4m3fn  # (vLLM's names)
    assert pick_kv_dtype("fp8_e5m2", torch.bfloat16, dense) == torch.float8_e5m2
    assert pick_kv_dtype("int8", torch.float32, dense) == torch.int8


def _engine_of(model, backend=None):
    """(runner, scheduler) of the model on the CPU backend, or on `backend`."""
    from contextlib import nullcontext
    from unittest import mock

    from sluice.engine.block_manager import BlockManager
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.scheduler import Scheduler

    with mock.patch("sluice.engine.model_runner.select_backend", return_value=backend) if backend else nullcontext():
        runner = ModelRunner(model, 256, 16, torch.float32, torch.device("cpu"), 256)
    return runner, Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_quantized_model_decodes_in_one_call_with_the_dequantized_weights_logits(isa, tmp_path, monkeypatch):
    """The layers of each step in one call (csrc/f32_layers.c, its linears on the quantized product), the
    embedding and LM head on the quantized table: every step's logits within float32 rounding of torch's path
    over the same weights dequantized to float32, the same greedy tokens, batched (prefill chunks beside
    decodes); a biased Qwen2 (`--quantization q4`: Q4_0 linears, a Q8_0 table) whose down projection
    (K = 88) stays float32 beside quantized ones."""
    from unittest import mock

    from sluice.app.builtin_models import write_llama_family
    from sluice.engine.cpu.stack import DecoderStack
    from sluice.engine.loader import load_model
    from tests.engine.helpers import seq

    kernel_build.clear()
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")  # (int8, the default for Q4_0, moves the logits)
    path = write_llama_family(tmp_path / "m", architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=2,
                              head_dim=32, intermediate_size=88, num_shards=1)
    model = load_model(path, torch.float32, torch.device("cpu"), "q4")
    ref = load_model(path, torch.float32, torch.device("cpu"), "q4")
    for module in ref.modules():  # (the reference: the same values in float32, on torch's path)
        if getattr(module, "quant", None) is not None:
            module.weight = torch.nn.Parameter(dequantized(module.quant), requires_grad=False)
            module.quant = None
    (runner, sched), (ref_runner, ref_sched) = _engine_of(model), _engine_of(ref, TORCH)
    assert runner.one_call and isinstance(runner.lm_head, QuantLMHead)
    stack = runner.model.model.stack.stack
    assert {type(k).__name__ for layer in stack._layers for k in (layer.qkv, layer.down)} == {"QuantMatmul",
                                                                                              "F32Matmul"}
    prompts = [[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3]
    for i, p in enumerate(prompts):
        sched.add(seq(f"r{i}", p, max_tokens=8, temperature=0.0))
        ref_sched.add(seq(f"r{i}", p, max_tokens=8, temperature=0.0))
    run, calls = DecoderStack.__call__, []

    def spy(stack, *args):
        calls.append(run(stack, *args))
        return calls[-1]

    with mock.patch.object(DecoderStack, "__call__", autospec=True, side_effect=spy):
        _in_lockstep(runner, sched, ref_runner, ref_sched)
    assert calls and all(calls)
    kernel_build.clear()


@pytest.mark.parametrize("isa", ISAS[:1], indirect=True)
def test_int8_activations_run_in_one_call_as_they_do_op_by_op(isa, tmp_path, monkeypatch):
    """With int8 activations the one-call step (csrc/f32_layers.c) quantizes each linear's rows as the op-by-op
    kernel does: every step's logits within float32 rounding of the same model run op by op, the same greedy
    tokens, batched (prefill chunks beside decodes), on Q4_1 linears (a min per block) and a Q8_0 table. (The
    AVX2 build's int8 tiles are the kernel tests' above; the step's glue is the same source.)"""
    from unittest import mock

    from sluice.app.builtin_models import write_llama_family
    from sluice.engine.cpu.stack import DecoderStack
    from sluice.engine.loader import load_model
    from tests.engine.helpers import seq

    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "int8")
    path = write_llama_family(tmp_path / "m", architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=2,
                              head_dim=32, intermediate_size=128, num_shards=1)
    model = load_model(path, torch.float32, torch.device("cpu"), "q4")
    for module in model.modules():  # (Q4_0 -> Q4_1: the path with a min)
        if getattr(module, "quant", None) is not None:
            module.quant = tuple(quantize(dequantized((p,)), "Q4_1") for p in module.quant)
    ref = load_model(path, torch.float32, torch.device("cpu"), "q4")
    for module, ref_module in zip(model.modules(), ref.modules()):
        if getattr(module, "quant", None) is not None:
            ref_module.quant = module.quant
    runner, sched = _engine_of(model)
    with mock.patch.object(DecoderStack, "build", return_value=None):
        ref_runner, ref_sched = _engine_of(ref)
    assert runner.one_call and not ref_runner.one_call
    kinds = {(type(k).__name__, k.int8) for layer in runner.model.model.stack.stack._layers for k in (layer.qkv,
                                                                                                     layer.down)}
    assert kinds == {("QuantMatmul", True)}
    assert all(p.type & 0x100 for layer in runner.model.model.stack.stack._layers for p in layer.qkv.spec)  # (repacked)
    for i, p in enumerate([[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3]):
        sched.add(seq(f"r{i}", p, max_tokens=4, temperature=0.0))
        ref_sched.add(seq(f"r{i}", p, max_tokens=4, temperature=0.0))
    _in_lockstep(runner, sched, ref_runner, ref_sched)


def _in_lockstep(runner, sched, ref_runner, ref_sched) -> None:
    """Both engines step by step on the same tokens: every step's logits within float32 rounding, the same
    greedy tokens."""
    while (batch := sched.schedule()) is not None:
        ref_batch = ref_sched.schedule()
        logits, _ = runner.forward(batch)
        ref_logits, _ = ref_runner.forward(ref_batch)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        tokens = logits.argmax(-1).tolist()
        assert ref_logits.argmax(-1).tolist() == tokens
        sched.update(batch, tokens)
        ref_sched.update(ref_batch, tokens)


def test_auto_activations_are_the_path_measured_faster_and_logged(monkeypatch, caplog):
    """SLUICE_QUANT_ACTIVATIONS=auto: int8 or float, whichever ran a decode row's product faster at start, the
    choice and the ratio logged once (the kernels built for this CPU; without them, float)."""
    import logging

    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "auto")
    kernel_build.clear()
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        chosen = cpu_quant.activations()
        assert cpu_quant.activations() == chosen
    measured = [r.getMessage() for r in caplog.records if "measured" in r.getMessage()]
    if cpu_quant.library() is None:
        assert chosen == "float" and not measured
    else:
        assert len(measured) == 1 and measured[0].startswith(f"quantized linears: {chosen} activations, measured")
        ratio = float(measured[0].split("int8 at ")[1].split("x")[0])
        assert ratio >= 1 if chosen == "int8" else ratio <= 1
    kernel_build.clear()
