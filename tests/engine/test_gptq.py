"""GPTQ and AWQ int4 checkpoints (sluice/engine/gptq.py): weights packed here as each format defines its
tensors, read back into block formats (or dequantized) with the same values, a tiny checkpoint of each served
with the logits of transformers' float model of the dequantized weights, and what is refused."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from sluice.app.builtin_models import save_sharded, write_llama_family
from sluice.app.cli import config_from_args, parse_args
from sluice.engine import gptq, gptq_config
from sluice.engine.loader import checkpoint_files, load_model
from sluice.engine.quant import dequantized
from tests.engine.helpers import assert_logits_match, make_engine, seq

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: the field i of a word takes column AWQ_ORDER[i] of its 8
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _words(fields: np.ndarray) -> torch.Tensor:
    """[..., 8 W] 4-bit values -> int32 [..., W], field i of a word in bits 4i .. 4i + 3."""
    f = fields.astype(np.uint64).reshape(*fields.shape[:-1], -1, 8)
    words = np.zeros(f.shape[:-1], dtype=np.uint64)
    for i in range(8):
        words |= f[..., i] << np.uint64(4 * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor | None,
              v1: bool) -> dict[str, torch.Tensor]:
    """q [N, K], zeros / scales [N, G] as a GPTQ checkpoint stores them: qweight [K / 8, N] packed along K,
    qzeros [G, N / 8] along N (minus one in v1), scales [G, N], g_idx [K]."""
    out = {"qweight": _words(q.numpy()).t().contiguous(),  # 8 consecutive k in one word
           "qzeros": _words((zeros - int(v1)).t().contiguous().numpy()),
           "scales": scales.t().contiguous()}
    if groups is not None:
        out["g_idx"] = groups.to(torch.int32)
    return out


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [N, K], zeros / scales [N, G] as AutoAWQ's GEMM packing stores them: qweight [K, N / 8] and qzeros
    [G, N / 8], each word's field i holding column AWQ_ORDER[i] of its 8; scales [G, N]."""
    def interleave(t: torch.Tensor) -> np.ndarray:  # [rows, N] -> columns in field order
        n = t.shape[1]
        order = [c * 8 + AWQ_ORDER[i] for c in range(n // 8) for i in range(8)]
        return t[:, order].numpy()

    return {"qweight": _words(interleave(q.t())), "qzeros": _words(interleave(zeros.t())),
            "scales": scales.t().contiguous()}


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, groups: torch.Tensor | None = None):
    """Round-to-nearest 4-bit quantization of a float weight [N, K] per group of input columns (`groups`
    [K] the group of each, k // group_size unless given): (q, zeros, float16 scales)."""
    n, k = w.shape
    groups = torch.arange(k) // group_size if groups is None else groups
    count = int(groups.max()) + 1
    q = torch.zeros(n, k, dtype=torch.int16)
    zeros = torch.zeros(n, count, dtype=torch.int16)
    scales = torch.zeros(n, count, dtype=torch.float16)
    for g in range(count):
        cols = groups == g
        x = w[:, cols]
        if sym:
            s = (x.abs().amax(1) / 7.5).half()
            z = torch.full((n,), 8, dtype=torch.int16)
        else:
            lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half()
            z = (-lo / s.float()).round().clamp(1, 15).to(torch.int16)  # (v1 stores z - 1 in 4 bits)
        q[:, cols] = (x / s.float()[:, None] + z[:, None]).round().clamp(0, 15).to(torch.int16)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, groups


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
    "gptq-v1-asym": (gptq_config.Scheme("gptq", 64, True), False, 64, "Q8_0"),
    "gptq-v2-asym": (gptq_config.Scheme("gptq", 128, False), False, 128, "Q8_0"),
    "gptq-per-channel": (gptq_config.Scheme("gptq", -1, True), True, 256, "Q4_0"),
    "awq": (gptq_config.Scheme("awq", 64, False), False, 64, "Q8_0"),
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


def test_act_order_is_dequantized_exactly():
    """desc_act: g_idx gives each input column its group in the order GPTQ quantized them, so a block of 32
    columns spans groups: no block format holds it, and the weight is dequantized."""
    n, k, group_size = 16, 128, 32
    q, zeros, scales, _ = _random(n, k, group_size, False, seed=3, zero_range=(1, 17))
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    groups = torch.empty(k, dtype=torch.long)
    groups[perm] = torch.arange(k) // group_size
    w = gptq.unpack(gptq_config.Scheme("gptq", group_size, True), pack_gptq(q, zeros, scales, groups, v1=True))
    assert gptq.to_blocks(w) is None
    assert torch.equal(w.dequantize().double(), reference(q, zeros, scales, groups))


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


# name: (write_llama_family's arguments, quantization_config, symmetric, act order, layer kinds expected)
MODELS: dict[str, tuple[dict, dict, bool, bool, set[str]]] = {
    "gptq-sym-qwen3": (dict(architecture="Qwen3ForCausalLM"),
                       {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
                       True, False, {"Q4_0"}),
    "gptq-act-order-llama": (dict(architecture="LlamaForCausalLM", tie_word_embeddings=False),
                             {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
                             False, True, {"dequantized"}),
    "awq-qwen2-bias": (dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=False),
                       {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True},
                       False, False, {"Q8_0"}),
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
    gen = torch.Generator().manual_seed(7)
    for name, w in list(floats.items()):
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(LINEARS):
            packed[name] = w
            continue
        groups = None
        if act_order:  # GPTQ's act order: the columns quantized in a permuted order, grouped in that order
            perm = torch.randperm(w.shape[1], generator=gen)
            groups = torch.empty(w.shape[1], dtype=torch.long)
            groups[perm] = torch.arange(w.shape[1]) // config["group_size"]
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
                seen.update(p.qtype.name for p in layer.quant)
                assert torch.equal(dequantized(layer.quant), expected)
    assert seen == kinds


def test_logits_equal_the_float_model_of_the_dequantized_weights(checkpoints, monkeypatch):
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")  # (int8, the default for its blocks, moves logits)
    path, hf, _, _ = checkpoints
    runner, sched = make_engine(path, block_size=8)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 57)), [300] * 3]
    seqs = [seq(f"r{i}", p, max_tokens=4, temperature=0.0) for i, p in enumerate(prompts)]
    assert assert_logits_match(runner, sched, hf, seqs, tol=1e-4) == len(prompts) * 4


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
    assert [p.qtype.name for p in qkv.quant] == ["Q8_0"] * 3
    values = 2 * 8 * 3 * 32 * 64  # (two mixture layers of 8 experts)
    assert (f"GPTQ int4 experts dequantized at load (no quantized expert kernel): {values} values, "
            f"{values * 4 / 2**20:.1f} MiB in torch.float32 (8 times their 4 bits)") in caplog.text
