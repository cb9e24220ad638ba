"""GPTQ and AWQ int4 checkpoints (sluice/engine/gptq.py): weights packed here as each format defines its
tensors, read back into block formats (or dequantized) with the same values, a tiny checkpoint of each served
with the logits of transformers' float model of the dequantized weights, and what is refused."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from sluice.app.builtin_models import save_sharded, write_llama_family
from sluice.app.cli import config_from_args, parse_args
from sluice.app.gptq_writer import act_order_groups, pack_gptq, quantize_rtn, words
from sluice.engine import gptq, gptq_config
from sluice.engine.cpu.quant import QuantMatmul
from sluice.engine.loader import checkpoint_files, load_model
from sluice.engine.quant import dequantized
from tests.engine import test_quant
from tests.engine.helpers import assert_logits_match, make_engine, seq
from tests.engine.test_quant import ISAS

isa = test_quant.isa  # (the fixture: the kernels built for one instruction set)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: the field i of a word takes column AWQ_ORDER[i] of its 8
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [N, K], zeros / scales [N, G] as AutoAWQ's GEMM packing stores them: qweight [K, N / 8] and qzeros
    [G, N / 8], each word's field i holding column AWQ_ORDER[i] of its 8; scales [G, N]."""
    def interleave(t: torch.Tensor) -> np.ndarray:  # [rows, N] -> columns in field order
        n = t.shape[1]
        order = [c * 8 + AWQ_ORDER[i] for c in range(n // 8) for i in range(8)]
        return t[:, order].numpy()

    return {"qweight": words(interleave(q.t())), "qzeros": words(interleave(zeros.t())),
            "scales": scales.t().contiguous()}


def reference(q, zeros, scales, groups) -> torch.Tensor:
    """W[n, k] = s[n, g(k)] (q[n, k] - z[n, g(k)]), in float64."""
    return scales.double()[:, groups] * (q.double() - zeros.double()[:, groups])


def _random(n, k, group_size, sym, seed, zero_range=(0, 16)):
    gen = torch.Generator().manual_seed(seed)
    count = k // group_size
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int16)
    zeros = (torch.full((n, count), 8, dtype=torch.int16) if sym
             else torch.randint(*zero_range, (n, count), generator=gen, dtype=torch.int16))
    scales = (torch.rand(n, count, generator=gen) * 0.02 + 1e-3).half()
    return q, zeros, scales, torch.arange(k) // group_size


CASES = {  # name: (scheme, symmetric, group size, the block format expected)
    "gptq-v1-sym": (gptq_config.Scheme("gptq", 32, True), True, 32, "Q4_0"),
    "gptq-v1-asym": (gptq_config.Scheme("gptq", 64, True), False, 64, "Q5_0"),
    "gptq-v2-asym": (gptq_config.Scheme("gptq", 128, False), False, 128, "Q5_0"),
    "gptq-per-channel": (gptq_config.Scheme("gptq", -1, True), True, 256, "Q4_0"),
    "awq": (gptq_config.Scheme("awq", 64, False), False, 64, "Q5_0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_weights_read_back_exactly_in_a_block_format(case):
    s, sym, group_size, expected = CASES[case]
    n, k = 48, 256
    # GPTQ v1 stores zero - 1 in 4 bits: its zero points are 1..16
    q, zeros, scales, groups = _random(n, k, group_size, sym, seed=len(case),
                                       zero_range=(1, 17) if s.v1_zeros else (0, 16))
    packed = (pack_awq(q, zeros, scales) if s.method == "awq"
              else pack_gptq(q, zeros, scales, groups if case == "gptq-v1-asym" else None, s.v1_zeros))
    w = gptq.unpack(s, packed)
    assert torch.equal(w.q.to(torch.int16), q) and torch.equal(w.zeros, zeros) and torch.equal(w.groups, groups)
    blocks = gptq.to_blocks(w)
    assert blocks is not None and blocks.qtype.name == expected and blocks.shape == (n, k)
    # the values the kernels compute with (the gguf package's dequantization of the blocks) are exact
    assert torch.equal(blocks.dequantize().double(), reference(q, zeros, scales, groups))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_act_order_is_held_as_blocks_of_its_columns_sorted_by_group(isa):
    """desc_act: g_idx gives each input column its group in the order GPTQ quantized them, so a block of 32
    columns spans groups: sorted by group (stable), each group is whole blocks, held exactly as they are, x read
    in that order (`perm`). The product, on both paths and both builds, is x times the weight in x's order."""
    n, k, group_size = 16, 128, 32
    q, zeros, scales, _ = _random(n, k, group_size, False, seed=3, zero_range=(1, 17))
    groups = act_order_groups(torch.randperm(k, generator=torch.Generator().manual_seed(1)), group_size)
    w = gptq.unpack(gptq_config.Scheme("gptq", group_size, True), pack_gptq(q, zeros, scales, groups, v1=True))
    assert gptq.to_blocks(w) is None
    held = gptq.sorted_blocks(w)
    assert held is not None and held.qtype.name == "Q5_0" and held.perm.dtype == torch.int32
    assert torch.equal(groups[held.perm.long()], torch.arange(k) // group_size)  # (each group whole blocks)
    want = reference(q, zeros, scales, groups)
    assert torch.equal(w.dequantize().double(), want) and torch.equal(held.dequantize().double(), want)
    x = torch.randn(5, k, dtype=torch.float64)
    size = x.abs() @ want.abs().T
    # (int8: x quantized per block of 32 of its columns in the stored order: half a level a value)
    level = x[:, held.perm.long()].view(5, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(5, k)
    rounding = (level / 254) @ want[:, held.perm.long()].abs().T
    for int8 in (False, True):
        got = QuantMatmul.build(held, None, int8=int8)(x.float()).double()
        assert ((got - x @ want.T).abs() <= (rounding if int8 else 0) + 1e-5 * size + 1e-5).all(), int8
    unsorted = QuantMatmul.build(dataclasses.replace(held, perm=None), None, int8=False)(x.float()).double()
    assert not ((unsorted - x @ want.T).abs() <= 1e-5 * size + 1e-5).all()  # (the order is what makes it right)


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}}, "dynamic"),
])
def test_what_is_not_served_is_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        gptq_config.scheme({"quantization_config": config})


def test_served_schemes():
    scheme, Scheme = gptq_config.scheme, gptq_config.Scheme
    assert scheme({}) is None
    assert scheme({"quantization_config": {"quant_method": "mxfp4"}}) is None  # gpt-oss's model reads it
    assert scheme({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                           "desc_act": True}}) == Scheme("gptq", 128, True)
    assert scheme({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                           "checkpoint_format": "gptq_v2"}}) == Scheme("gptq", -1, False)
    assert scheme({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM",
                                           "zero_point": True}}) == Scheme("awq", 128, False)


# name: (write_llama_family's arguments, quantization_config, symmetric, act order ("", "shared" by the linears
# that read one input, or each linear's "own"), layer kinds expected)
MODELS: dict[str, tuple[dict, dict, bool, str, set[str]]] = {
    "gptq-sym-qwen3": (dict(architecture="Qwen3ForCausalLM"),
                       {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
                       True, "", {"Q4_0"}),
    # act order as GPTQ writes it: the linears that read one input (q, k, v; gate, up) in one order (their
    # Hessian's), held as blocks of their columns sorted by group
    "gptq-act-order-llama": (dict(architecture="LlamaForCausalLM", tie_word_embeddings=False),
                             {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
                             False, "shared", {"Q5_0 (act order)"}),
    # each linear in an order of its own: a stacked projection's parts cannot read x in one, and are dequantized
    "gptq-act-order-own-orders": (dict(architecture="Qwen3ForCausalLM"),
                                  {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True},
                                  True, "own", {"Q4_0 (act order)", "dequantized"}),
    "awq-qwen2-bias": (dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=False),
                       {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True},
                       False, "", {"Q5_0"}),
}


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoints(request, tmp_path_factory):
    """(the quantized checkpoint, transformers' float model of its dequantized weights, those weights by
    linear, what each linear is expected to be held as)."""
    arch, config, sym, act_order, kinds = MODELS[request.param]
    ref = write_llama_family(tmp_path_factory.mktemp(request.param + "-float"), **arch)
    quant = tmp_path_factory.mktemp(request.param)
    shutil.copytree(ref, quant, dirs_exist_ok=True)
    floats, packed, dequant = _tensors(ref), {}, {}
    gen, orders = torch.Generator().manual_seed(7), {}
    for name, w in list(floats.items()):
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(LINEARS):
            packed[name] = w
            continue
        groups = None
        if act_order:  # GPTQ's act order: the columns quantized in a permuted order, grouped in that order
            reads = prefix.rpartition(".")[0] + ("" if prefix.endswith(("o_proj", "down_proj")) else "/input")
            key = reads if act_order == "shared" else prefix
            order = orders[key] = orders[key] if key in orders else torch.randperm(w.shape[1], generator=gen)
            groups = act_order_groups(order, config["group_size"])
        q, zeros, scales, groups = quantize_rtn(w, config["group_size"], sym, groups)
        dequant[prefix] = reference(q, zeros, scales, groups).float()
        floats[name] = dequant[prefix]
        if config["quant_method"] == "awq":
            parts = pack_awq(q, zeros, scales)
        else:
            parts = pack_gptq(q, zeros, scales, groups, v1=True)
            packed[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # AutoGPTQ's zero bias
        packed.update({f"{prefix}.{sfx}": t for sfx, t in parts.items()})
    save_sharded(ref, floats, 2)
    save_sharded(quant, packed, 2)
    hf_config = json.loads((quant / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return quant, hf, dequant, kinds


def test_each_linear_holds_the_dequantized_weights(checkpoints):
    path, _, dequant, kinds = checkpoints
    model = load_model(path, torch.float32, torch.device("cpu"))
    seen = set()
    for i in range(2):
        for stacked, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", None),
                               ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", None)):
            layer = model.get_submodule(f"model.layers.{i}.{stacked}")
            names = [stacked] if parts is None else [f"{stacked.split('.')[0]}.{p}" for p in parts]
            expected = torch.cat([dequant[f"model.layers.{i}.{n}"] for n in names])
            if layer.quant is None:
                seen.add("dequantized")
                assert torch.equal(layer.weight, expected)
            else:
                seen.update(p.qtype.name + ("" if p.perm is None else " (act order)") for p in layer.quant)
                assert torch.equal(dequantized(layer.quant), expected)
    assert seen == kinds


def test_logits_equal_the_float_model_of_the_dequantized_weights(checkpoints, monkeypatch):
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")  # (int8, the default for its blocks, moves logits)
    path, hf, _, _ = checkpoints
    runner, sched = make_engine(path, block_size=8)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3]
    seqs = [seq(f"r{i}", p, max_tokens=4, temperature=0.0) for i, p in enumerate(prompts)]
    assert assert_logits_match(runner, sched, hf, seqs, tol=1e-4) == len(prompts) * 4


def test_act_order_runs_in_the_step_in_one_call_with_int8_activations(checkpoints, monkeypatch):
    """The default path: an act-order linear's rows of x read through its order as they are quantized, inside
    the decode step in one call (csrc/f32_layers.c) as op by op: the same hidden states and caches."""
    path, _, _, kinds = checkpoints
    if not any(k.endswith("(act order)") for k in kinds):
        pytest.skip("not an act-order checkpoint")
    monkeypatch.delenv("SLUICE_QUANT_ACTIVATIONS", raising=False)
    runner, sched = make_engine(path, block_size=8)
    ordered = [m.run for m in runner.model.modules() if isinstance(getattr(m, "run", None), QuantMatmul)
               and m.run.perm is not None]
    assert runner.one_call and ordered and all(k.int8 for k in ordered)
    for i, p in enumerate([[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3]):
        sched.add(seq(f"r{i}", p, max_tokens=20, temperature=0.0))
    for _ in range(3):
        batch = sched.schedule()
        sched.update(batch, runner.run(batch).tokens)
    batch, backbone = sched.schedule(), runner.model.model
    out, ran = {}, []
    for fused in (True, False):
        saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        stack = backbone.stack
        backbone.stack = (lambda *a: ran.append(stack(*a)) or ran[-1]) if fused else None
        with torch.inference_mode():
            out[fused] = runner._hidden(batch)[0], [k.clone() for k, _ in runner.kv_caches]
        backbone.stack = stack
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
            k.copy_(k0), v.copy_(v0)
    assert ran == [True]  # (the step ran in one call)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_refused_checkpoint_fails_at_start_naming_the_field(checkpoints, tmp_path):
    """`sluice serve` refuses it before starting a process (and the loader, for any other caller)."""
    path, _, _, _ = checkpoints
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.bits = 3"):
        config_from_args(parse_args(["serve", "--model", str(tmp_path)]))
    with pytest.raises(ValueError, match="quantization_config.bits = 3"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_a_mixtures_packed_experts_are_dequantized_at_load(tmp_path, caplog):
    """A GPTQ Qwen3-MoE checkpoint (every expert and attention linear packed): the attention linears held in
    a block format, each expert's weights dequantized into the stacked expert tensors (no quantized expert
    kernel), the memory that takes logged."""
    from tests.engine.test_moe import write_checkpoint

    write_checkpoint(tmp_path, "qwen3-moe")
    tensors, dequant = _tensors(tmp_path), {}
    for file in checkpoint_files(tmp_path):
        file.unlink()
    packed = {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix.rpartition(".")[2] not in {n.split(".")[1] for n in LINEARS}:
            packed[name] = w
            continue
        q, zeros, scales, groups = quantize_rtn(w, 32, False)
        dequant[prefix] = reference(q, zeros, scales, groups).float()
        packed.update({f"{prefix}.{sfx}": t for sfx, t in pack_gptq(q, zeros, scales, None, v1=True).items()})
    save_sharded(tmp_path, packed, 1)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}}))
    with caplog.at_level("INFO", logger="sluice.engine"):
        model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    experts = model.get_submodule("model.layers.0.mlp.experts")
    for e in range(8):
        block = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(experts.gate_up_proj[e], torch.cat([dequant[f"{block}.gate_proj"],
                                                               dequant[f"{block}.up_proj"]]))
        assert torch.equal(experts.down_proj[e], dequant[f"{block}.down_proj"])
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert [p.qtype.name for p in qkv.quant] == ["Q5_0"] * 3
    values = 2 * 8 * 3 * 32 * 64  # (two mixture layers of 8 experts)
    assert (f"GPTQ int4 experts dequantized at load (no quantized expert kernel): {values} values, "
            f"{values * 4 / 2**20:.1f} MiB in torch.float32 (8 times their 4 bits)") in caplog.text
