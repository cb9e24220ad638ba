"""One GGUF file served as a model (sluice/gguf_checkpoint.py, engine/gguf.py) against transformers reading the
same file (it dequantizes every tensor: the reference), for tiny random Llama, Qwen2 and Qwen3 checkpoints
written as GGUF files with every block format the kernels read (the Llama file's Q5_0 / Q5_1 where
llama-quantize's Q4_K_M / Q5_K_M put them)."""
from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from sluice.app.builtin_models import resolve_model, write_llama_family
from sluice.app.gguf_writer import write_gguf
from sluice.base.gguf_checkpoint import gguf_checkpoint, is_gguf_checkpoint
from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu.quant import QuantMatmul
from sluice.engine.gguf import hf_name
from sluice.engine.layers import stacked_parts
from sluice.engine.loader import load_model
from sluice.engine.quant import dequantized
from tests.engine.helpers import generate, make_engine, seq

# (transformers' GGUF reader takes Qwen3's head_dim from its config's default, 128)
VARIANTS = {
    "qwen3-tied": dict(architecture="Qwen3ForCausalLM", head_dim=128),
    "qwen2-bias": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=False, head_dim=64),
    "llama": dict(architecture="LlamaForCausalLM", tie_word_embeddings=False, head_dim=64),
}
# every type the kernels read, a stacked projection's parts of different types (as in Q4_K_M files)
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q8_0", "ffn_down": "Q6_K"}
# ... and in the Llama file the fallbacks of llama-quantize's Q4_K_M / Q5_K_M for rows of 576 (Q8_0 is the
# tables' default type; Q4_0 stays in the others)
Q5_TYPES = {"llama": {"attn_output": "Q5_0", "ffn_up": "Q5_1"}}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), list(range(100, 171, 2)), [300] * 3]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gguf_model(request, tmp_path_factory):
    """(the checkpoint, the GGUF file, its metadata directory, transformers' model of the file)"""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_llama_family(root / "checkpoint", hidden_size=256, num_heads=4, num_kv_heads=2,
                                    intermediate_size=512, num_shards=1, **VARIANTS[request.param])
    file = write_gguf(checkpoint, root / "model.gguf", {**TYPES, **Q5_TYPES.get(request.param, {})})
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file="model.gguf", dtype=torch.float32).eval()
    assert not {"attn_q", "attn_k"} & set(Q5_TYPES.get(request.param, {}))  # (rows the loader permutes)
    return checkpoint, file, gguf_checkpoint(file, root / "meta"), hf


def _exact(t) -> np.ndarray:
    """A GGUF tensor's values [N, K] as the gguf package dequantizes it (llama.cpp's definitions)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))


@pytest.fixture
def float_activations(monkeypatch):
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")
    kernel_build.clear()
    yield
    kernel_build.clear()


def test_a_gguf_path_resolves_to_a_metadata_directory_of_the_file(gguf_model, monkeypatch, tmp_path):
    checkpoint, file, meta, _ = gguf_model
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    path = resolve_model(str(file))
    assert is_gguf_checkpoint(path) and path.is_relative_to(tmp_path)
    assert resolve_model(str(file)) == path  # (written once)
    assert {p.name for p in meta.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json",
                                                  "generation_config.json", "chat_template.jinja"}
    assert (meta / "chat_template.jinja").read_text() == (checkpoint / "chat_template.jinja").read_text()


def test_the_tokenizer_from_the_metadata_encodes_as_the_checkpoints(gguf_model):
    checkpoint, _, meta, _ = gguf_model
    ours, theirs = (Tokenizer.from_file(str(p / "tokenizer.json")) for p in (meta, checkpoint))
    for text in ["Hello, world! It's 2026.", "<|im_start|>user\nhi there<|im_end|>\n", "  spaces\t\tand\nlines  ",
                 "unicode: café, 日本語, emoji 🎉"]:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_linears_and_tables_stay_quantized_and_dequantize_to_transformers_weights(gguf_model):
    """Every layer's linear, the token embedding and the LM head (the embedding where tied) stay quantized."""
    _, file, meta, hf = gguf_model
    model = load_model(meta, torch.float32, torch.device("cpu"))
    reference = hf.state_dict()
    quantized = {name: m for name, m in model.named_modules() if getattr(m, "quant", None) is not None}
    tables = ["model.embed_tokens", *([] if hf.config.tie_word_embeddings else ["lm_head"])]
    assert len(quantized) == 4 * hf.config.num_hidden_layers + len(tables)
    assert model.lm_weight() is quantized[tables[-1]].quant[0]
    for name, module in quantized.items():
        assert module.weight.numel() == 0
        prefix, _, leaf = name.rpartition(".")
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf,
                                                                                                          (leaf,))
        want = torch.cat([reference[f"{prefix}.{p}.weight".lstrip(".")] for p in parts])
        assert torch.equal(dequantized(module.quant), want), name
    assert [q.qtype.name for q in quantized["model.layers.0.self_attn.qkv_proj"].quant] == ["Q4_K", "Q5_K", "Q6_K"]
    # the unpermuted (Llama) q / k rows are copies; the other parts lie in the file's memory map
    v = quantized["model.layers.0.self_attn.qkv_proj"].quant[2]
    assert not v.data.numpy().flags.owndata
    _assert_q5_kept(file, model, hf.config.model_type)


def _assert_q5_kept(file, model, variant: str) -> None:
    """Q5_0 and Q5_1 tensors are held as they lie in the file's map, their values exactly the gguf package's."""
    parts = {part: q for name, m in model.named_modules() if getattr(m, "quant", None) is not None
             for part, q in zip(stacked_parts(f"{name}.weight") or [f"{name}.weight"], m.quant)}
    seen = set()
    for t in gguf.GGUFReader(str(file)).tensors:
        kind = t.tensor_type.name
        if kind not in ("Q5_0", "Q5_1"):
            continue
        part = parts[hf_name(t.name)]
        assert part.qtype.name == kind and part.mapped and not part.data.numpy().flags.owndata
        assert np.array_equal(part.dequantize().numpy(), _exact(t)), t.name
        seen.add(kind)
    assert seen == set(Q5_TYPES.get(variant, {}).values())


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunked prefill
def test_logits_match_transformers_through_prefill_and_decode(gguf_model, float_activations, budget):
    """Float activations against transformers in float64 on the same dequantized weights: float32's rounding
    alone (transformers' own float32 run is about as far off)."""
    _, _, meta, hf = gguf_model
    hf64 = copy.deepcopy(hf).double()
    runner, sched = make_engine(meta, budget=budget, block_size=8)
    linears = [m.run for m in runner.model.modules() if hasattr(m, "run") and m.quant is not None]
    assert all(isinstance(k, QuantMatmul) and not k.int8 for k in linears)
    assert runner.one_call  # (the fused step runs the quantized linears too)
    for i, p in enumerate(PROMPTS):
        sched.add(seq(f"r{i}", p, max_tokens=6, temperature=0.0))
    worst, rows = 0.0, 0
    while (batch := sched.schedule()) is not None:
        logits, sampling = runner.forward(batch)
        for row, s in enumerate(sampling):
            with torch.no_grad():
                ref = hf64(torch.tensor([s.token_ids])).logits[0, -1]
            worst = max(worst, ((logits[row].double() - ref).abs().max() / ref.abs().max()).item())
            rows += 1
        sched.update(batch, logits.argmax(-1).tolist())
    assert rows == len(PROMPTS) * 6
    assert worst <= 3e-4, worst


def test_int8_activations_keep_every_linear_within_a_percent_on_the_models_own_rows(gguf_model):
    """Each linear of a prompt's forward, its int8-activation product against its float one on the rows the
    model gives it (the kernel tests bound each product; this is what that bound comes to on a model's
    activations). The whole model's logits are no test of it here: random weights amplify any rounding."""
    _, _, meta, _ = gguf_model
    runner, sched = make_engine(meta, block_size=8)
    errors = {}

    def compare(name):
        def hook(module, args, out):
            int8 = QuantMatmul.build(module.quant, module.bias, int8=True)(args[0])
            exact = QuantMatmul.build(module.quant, module.bias, int8=False)(args[0])
            errors[name] = ((int8 - exact).abs().max() / exact.abs().max()).item()
        return hook

    runner.model.model.stack = None  # (op by op: each linear's own call, which the hooks see)
    for name, module in runner.model.named_modules():
        if hasattr(module, "run") and module.quant is not None:
            module.register_forward_hook(compare(name))
    sched.add(seq("r", PROMPTS[2], max_tokens=1, temperature=0.0))
    runner.forward(sched.schedule())
    assert len(errors) == 8 and max(errors.values()) < 0.015, errors


def test_greedy_tokens_equal_transformers_generate_alone_and_batched(gguf_model, monkeypatch):
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")
    kernel_build.clear()
    _, _, meta, hf = gguf_model
    want = {}
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        want[f"r{i}"] = ref[0, len(p):].tolist()
    runner, sched = make_engine(meta, block_size=16)
    assert generate(runner, sched, [seq(f"r{i}", p, max_tokens=12, temperature=0.0)
                                    for i, p in enumerate(PROMPTS)]) == want
    for i, p in enumerate(PROMPTS):
        runner, sched = make_engine(meta, block_size=16)
        assert generate(runner, sched, [seq(f"r{i}", p, max_tokens=12, temperature=0.0)]) == {f"r{i}": want[f"r{i}"]}
    kernel_build.clear()


def test_on_avx2_the_same_tokens(gguf_model, monkeypatch):
    if not {"avx2", "fma"} <= kernel_build.cpu_flags():
        pytest.skip("this CPU lacks AVX2/FMA")
    _, _, meta, _ = gguf_model
    runner, sched = make_engine(meta, block_size=16)
    seqs = lambda: [seq(f"r{i}", p, max_tokens=8, temperature=0.0) for i, p in enumerate(PROMPTS)]  # noqa: E731
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")
    kernel_build.clear()
    best = generate(*make_engine(meta, block_size=16), seqs())
    monkeypatch.setenv("SLUICE_CPU_HIDE", "avx512f,avx512_vnni")
    kernel_build.clear()
    runner, sched = make_engine(meta, block_size=16)
    assert {m.run.isa for m in runner.model.modules() if hasattr(m, "run") and m.quant is not None} == {
        "AVX2, float activations"}
    assert generate(runner, sched, seqs()) == best
    kernel_build.clear()


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _step_logits(path, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each step's logits [B, V], greedy."""
    runner, sched = make_engine(path, block_size=16)
    for i, p in enumerate(prompts):
        sched.add(seq(f"r{i}", p, max_tokens=steps, temperature=0.0))
    out = []
    while (batch := sched.schedule()) is not None:
        logits, _ = runner.forward(batch)
        out.append(logits.clone())
        sched.update(batch, logits.argmax(-1).tolist())
    return out


def test_llama3_rope_factors_of_the_file_give_the_checkpoints_logits_past_the_original_context(tmp_path):
    """A Llama 3.1-style checkpoint (rope_scaling llama3, original context 64) written as llama.cpp writes it
    (the factors only as rope_freqs.weight, every tensor F32): served from the file, its logits at positions
    64-200 equal the safetensors checkpoint's; the same weights without the factors do not."""
    shape = dict(architecture="LlamaForCausalLM", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                 intermediate_size=512, num_shards=1, tie_word_embeddings=False, max_position_embeddings=512)
    checkpoint = write_llama_family(tmp_path / "checkpoint", rope_scaling=LLAMA3, **shape)
    plain = write_llama_family(tmp_path / "plain", **shape)  # (the same seed: the same weights)
    file = write_gguf(checkpoint, tmp_path / "model.gguf", {}, default="F32")
    meta = gguf_checkpoint(file, tmp_path / "meta")
    scaling = json.loads((meta / "config.json").read_text())["rope_scaling"]
    assert scaling.pop("rope_type") == "llama3"
    assert scaling == pytest.approx({k: v for k, v in LLAMA3.items() if k != "rope_type"}, rel=1e-5)
    prompts = [list(range(10, 160)), [7] * 90 + list(range(200, 300))]
    ours, want, unscaled = (_step_logits(p, prompts, 8) for p in (meta, checkpoint, plain))
    assert len(ours) == len(want) == 8
    for a, b, c in zip(ours, want, unscaled):
        scale = b.abs().max()
        assert (a - b).abs().max() <= 1e-4 * scale
        assert (c - b).abs().max() > 1e-2 * scale  # (the factors matter at these positions)
