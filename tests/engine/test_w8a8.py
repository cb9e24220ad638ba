"""compressed-tensors int8 checkpoints (sluice/engine/compressed_tensors.py): a tiny Llama written in
llm-compressor's W8A8 layout (int8 `weight`, `weight_scale` per channel, per group and per tensor), held as
per-channel int8 (Q8_C) or Q8_0 blocks of exactly its values and served with the logits of transformers' float
model of the dequantized weights (float activations) or of its linears' inputs rounded as the int8 path rounds
them (the default: per group of 128 values on the per-channel linears); scales no block format holds exactly;
what is refused."""
from __future__ import annotations

import gc
import json
import logging
import shutil
import weakref

import pytest
import torch
import transformers

from sluice.app.builtin_models import save_sharded, write_llama_family
from sluice.engine import compressed_tensors, gptq_config
from sluice.engine.cpu import quant as cpu_quant
from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.quant import RepackedWeight
from sluice.engine.layers import Linear
from sluice.engine.loader import load_model
from sluice.engine.quant import dequantized
from tests.engine.helpers import assert_logits_match, make_engine, seq
from tests.engine.test_gptq import _tensors

_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "dynamic": False}
_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True}
# as compressed-tensors' ModelCompressor writes it (three schemes, to cover each weight strategy)
CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "global_compression_ratio": None, "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {"targets": ["re:.*(q|k|v|gate|up)_proj$"], "weights": {**_INT8, "strategy": "channel"},
                    "input_activations": _TOKEN, "output_activations": None, "format": None},
        "group_1": {"targets": ["re:.*o_proj$"], "weights": {**_INT8, "strategy": "group", "group_size": 32},
                    "input_activations": _TOKEN, "output_activations": None, "format": None},
        "group_2": {"targets": ["re:.*down_proj$"], "weights": {**_INT8, "strategy": "tensor"},
                    "input_activations": _TOKEN, "output_activations": None, "format": None},
    },
}
LINEARS = {"q_proj": "channel", "k_proj": "channel", "v_proj": "channel", "gate_proj": "channel",
           "up_proj": "channel", "o_proj": "group", "down_proj": "tensor"}


def quantize_int8(w: torch.Tensor, strategy: str, group: int = 32) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """(int8 [N, K], weight_scale, the float32 values [N, K]) of a float weight, symmetric round-to-nearest
    as compressed-tensors quantizes it: the scale (bfloat16, as llm-compressor leaves a bfloat16 model's) =
    max |w| / 127 over the tensor ([1]), each row ([N, 1]) or each group of `group` columns ([N, K / group])."""
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().max() / 127).reshape(1).bfloat16()
        each = scale.float().expand(n, k)
    elif strategy == "channel":
        scale = (w.abs().amax(1, keepdim=True) / 127).bfloat16()
        each = scale.float().expand(n, k)
    else:
        scale = (w.reshape(n, k // group, group).abs().amax(2) / 127).bfloat16()
        each = scale.float().repeat_interleave(group, dim=1)
    q = torch.round(w / each).clamp(-128, 127).to(torch.int8)
    return q, scale, q.float() * each


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    """(the int8 checkpoint, transformers' float model of its dequantized weights, those weights by name)."""
    ref = write_llama_family(tmp_path_factory.mktemp("w8a8-float"), architecture="LlamaForCausalLM",
                             tie_word_embeddings=False, num_shards=1, intermediate_size=320)  # (down: 3 groups of x)
    quant = tmp_path_factory.mktemp("w8a8")
    shutil.copytree(ref, quant, dirs_exist_ok=True)
    floats, stored, dequant = _tensors(ref), {}, {}
    for name, w in floats.items():
        prefix, leaf = name.removesuffix(".weight"), name.split(".")[-2]
        if leaf not in LINEARS or not name.endswith(".weight"):
            stored[name] = w
            continue
        stored[name], stored[f"{prefix}.weight_scale"], dequant[name] = quantize_int8(w, LINEARS[leaf])
        floats[name] = dequant[name]
        if leaf == "down_proj":  # (a static-activation checkpoint's input scale: read, not used)
            stored[f"{prefix}.input_scale"] = torch.ones(1, dtype=torch.bfloat16)
    save_sharded(ref, floats, 1)
    save_sharded(quant, stored, 2)
    hf_config = json.loads((quant / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps({**hf_config, "quantization_config": CONFIG}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return quant, hf, dequant


def test_each_linear_holds_exactly_the_checkpoints_values(w8a8):
    """Scales per channel or per tensor: the int8 values and a float32 scale a row as stored (Q8_C); per group
    of 32: Q8_0 blocks."""
    path, _, dequant = w8a8
    model = load_model(path, torch.float32, torch.device("cpu"))
    stacks = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
              "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
    for i in range(2):
        for stacked, parts in stacks.items():
            layer = model.get_submodule(f"model.layers.{i}.{stacked}")
            kind = "Q8_0" if stacked == "self_attn.o_proj" else "Q8_C"
            assert [p.qtype.name for p in layer.quant] == [kind] * len(parts)
            block = stacked.split(".")[0]
            want = torch.cat([dequant[f"model.layers.{i}.{block}.{p}.weight"] for p in parts])
            assert torch.equal(dequantized(layer.quant), want), stacked
    assert getattr(model.lm_head, "quant", None) is None and model.lm_head.weight.dtype == torch.float32  # (float)


def test_a_model_read_into_memory_holds_its_weights_once_its_kernels_are_built(w8a8, monkeypatch):
    """Once the backend builds a linear's int8 kernel, the loaded bytes go (nothing holds them) and the layer
    holds the repacked copy the kernel reads (RepackedWeight), whose bytes unpack to the checkpoint's values: a
    W8A8 (or GPTQ / AWQ, or --quantization) model is held once, not twice."""
    monkeypatch.delenv("SLUICE_QUANT_ACTIVATIONS", raising=False)
    if cpu_quant.library() is None:
        pytest.skip("no quantized kernel builds here")
    path, _, dequant = w8a8
    model = load_model(path, torch.float32, torch.device("cpu"))
    backend, linears = CpuBackend(torch.float32), [m for m in model.modules() if isinstance(m, Linear)]
    loaded = [weakref.ref(p.data) for m in linears for p in m.quant]
    for m in linears:
        m.run = backend.linear(m)
    gc.collect()
    assert loaded and not [r for r in loaded if r() is not None]
    for i in range(2):
        for block, stacked, parts in (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                      ("mlp", "down_proj", ("down_proj",)), ("self_attn", "o_proj", ("o_proj",))):
            layer = model.get_submodule(f"model.layers.{i}.{block}.{stacked}")
            assert all(isinstance(p, RepackedWeight) and p.packed is q for p, q in zip(layer.quant, layer.run.packed))
            want = torch.cat([dequant[f"model.layers.{i}.{block}.{p}.weight"] for p in parts])
            assert torch.equal(dequantized(layer.quant), want)


def test_logits_equal_the_float_model_of_the_dequantized_weights(w8a8, monkeypatch):
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")  # (int8, the default for its blocks, moves logits)
    path, hf, _ = w8a8
    runner, sched = make_engine(path, block_size=8)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 57))]
    seqs = [seq(f"r{i}", p, max_tokens=3, temperature=0.0) for i, p in enumerate(prompts)]
    assert assert_logits_match(runner, sched, hf, seqs, tol=1e-4) == len(prompts) * 3


def _fake_quantized_inputs(hf: torch.nn.Module) -> list:
    """Hooks making transformers' model quantize each quantized linear's input as Sluice's int8 path does: per
    group of 128 values for the per-channel ones (csrc/quant_channel.h; the last group shorter), per block of 32
    for o_proj (Q8_0): d = max |x| / 127, x = d round(x / d)."""
    def quantize(group: int):
        def hook(_module, args):
            parts = []
            for part in args[0].split(group, dim=-1):
                d = part.abs().amax(-1, keepdim=True) / 127
                parts.append(torch.round(part / torch.where(d > 0, d, 1)) * d)
            return torch.cat(parts, dim=-1)
        return hook
    return [m.register_forward_pre_hook(quantize(32 if name.endswith("o_proj") else 128))
            for name, m in hf.named_modules() if name.split(".")[-1] in LINEARS]


def test_int8_activations_are_the_int8_product_of_x_per_group(w8a8, monkeypatch):
    """The default path: the per-channel linears' rows quantized per group of 128 values (csrc/quant_channel.h;
    finer than the checkpoint's per token), the Q8_0 one's per block of 32: the logits of transformers' float
    model with its linears' inputs so quantized, alone and batched, through the one-call step (decode) and op
    by op (prompts)."""
    monkeypatch.delenv("SLUICE_QUANT_ACTIVATIONS", raising=False)
    path, hf, _ = w8a8
    runner, sched = make_engine(path, block_size=8)
    stack = runner.model.model.stack.stack  # (the decode step in one call, csrc/f32_layers.c)
    qkv = stack._layers[0].qkv
    assert [p.qtype.name for p in qkv.parts] == ["Q8_C"] * 3 and qkv.int8
    assert [p.type for p in qkv.spec] == [64 | 0x100] * 3  # (Q8_C, repacked: csrc/quant_channel.h)
    hooks = _fake_quantized_inputs(hf)
    try:
        prompts = [[5, 6, 7, 8, 9], list(range(20, 57)), [3, 1, 4, 1, 5, 9, 2, 6]]
        seqs = [seq(f"r{i}", p, max_tokens=4, temperature=0.0) for i, p in enumerate(prompts)]
        assert assert_logits_match(runner, sched, hf, seqs, tol=2e-3) == len(prompts) * 4
    finally:
        for h in hooks:
            h.remove()


def test_scales_no_block_format_holds_exactly():
    """Groups smaller than a block of 32 are dequantized; float32 scales that are not float16 values are
    rounded to float16 (each weight off by at most 2^-11 of itself), unless that is under float16's normal
    numbers (dequantized)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 64, generator=gen)
    q, scale, want = quantize_int8(w, "group", group=16)
    assert compressed_tensors.to_blocks(q, scale) is None
    assert torch.equal(compressed_tensors.dequantize(q, scale), want)
    q, scale, _ = quantize_int8(w, "channel")
    fine = scale.float() * (1 + 1e-5)  # (not a float16 value)
    blocks, exact = compressed_tensors.to_blocks(q, fine)
    want = q.float() * fine
    assert not exact and ((blocks.dequantize() - want).abs() <= want.abs() * 2 ** -11).all()
    assert compressed_tensors.to_blocks(q, scale)[1]  # (bfloat16 scales: exact)
    assert compressed_tensors.to_blocks(q, fine * 2**-20) is None  # (under float16's normal numbers)


@pytest.mark.parametrize("change, field", [
    ({"format": "pack-quantized"}, "format"),
    ({"format": "float-quantized"}, "format"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config.format"),
    ({"group_0": {"num_bits": 4}}, "config_groups.group_0.weights.num_bits"),
    ({"group_0": {"symmetric": False}}, "config_groups.group_0.weights.symmetric"),
    ({"group_0": {"strategy": "block"}}, "config_groups.group_0.weights.strategy"),
])
def test_what_is_not_served_is_refused_naming_the_field(change, field):
    config = json.loads(json.dumps(CONFIG))
    if "group_0" in change:
        config["config_groups"]["group_0"]["weights"].update(change["group_0"])
    else:
        config.update(change)
    with pytest.raises(ValueError, match=f"quantization_config.{field} = "):
        gptq_config.scheme({"quantization_config": config})


def test_the_served_scheme():
    assert gptq_config.scheme({"quantization_config": CONFIG}) == gptq_config.Int8Scheme(
        ("channel", "group", "tensor"), ("int8 token dynamic",) * 3)


def test_an_experts_int8_weight_is_handed_to_its_model_dequantized(caplog):
    """What the loader's fetch gives a model that reads its own weights (a mixture's experts): the float32
    values, the tensors used (an all-zero zero point, a static input scale), the memory logged; an asymmetric
    weight refused."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    q, scale, want = quantize_int8(w, "channel")
    prefix = "model.layers.0.mlp.experts.3.up_proj"
    stored = {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale, f"{prefix}.input_scale": torch.ones(1),
              f"{prefix}.weight_zero_point": torch.zeros(16, 1, dtype=torch.int8), "model.norm.weight": w[0]}
    reader = compressed_tensors.Reader(gptq_config.scheme({"quantization_config": CONFIG}), torch.device("cpu"))
    values, used = reader.float_weight(prefix, stored.__contains__, stored.__getitem__)
    assert torch.equal(values, want) and sorted(used) == sorted(set(stored) - {"model.norm.weight"})
    assert reader.float_weight("model.norm", stored.__contains__, stored.__getitem__) is None
    with caplog.at_level("INFO", logger="sluice.engine"):
        reader.summary(torch.bfloat16)
    assert "int8 experts dequantized at load (no quantized expert kernel): 1024 values, 0.0 MiB in torch.bfloat16" \
        in caplog.text
    stored[f"{prefix}.weight_zero_point"] = torch.ones(16, 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight_zero_point: an asymmetric weight"):
        reader.float_weight(prefix, stored.__contains__, stored.__getitem__)


def test_a_quantized_model_under_bfloat16_is_told_float32_is_faster(w8a8, caplog):
    """The CPU's quantized kernels and the one-call step take float32 rows: --dtype bfloat16 runs, slower, and the
    log says so (vLLM's users pass it out of habit); float32, or a float model, says nothing."""
    from sluice.engine.engine import warn_dtype

    cpu, model = torch.device("cpu"), load_model(w8a8[0], torch.bfloat16, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="sluice.engine"):
        warn_dtype(cpu, torch.float32, model)
        warn_dtype(cpu, torch.bfloat16, w8a8[1])  # (transformers' float model: nothing quantized)
        assert not caplog.text
        warn_dtype(cpu, torch.bfloat16, model)
    assert "quantized linears under --dtype bfloat16" in caplog.text
