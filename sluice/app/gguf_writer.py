"""A Llama-family checkpoint directory (sluice/builtin_models.py's tiny ones) written as one GGUF file, as
llama.cpp's converter lays it out, its linears in chosen block formats: for tests and benchmarks of the GGUF
path (sluice/gguf_checkpoint.py, engine/gguf.py).

Q8_0, Q4_0 and Q4_1 are the checkpoint's weights quantized by the gguf package. The gguf package cannot
quantize to the K-quants, so a Q4_K / Q5_K / Q6_K tensor holds random blocks of about the weight's
magnitude instead (the file is then its own model: a reference reads the file, not the checkpoint).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sluice.engine.quant import BY_NAME, quantize

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# the scale fields of a K-quant block: (byte offset, the largest |scale * q| one unit of it gives)
_K_SCALES = {"Q4_K": ((0, 63 * 15), (2, 63)), "Q5_K": ((0, 63 * 31), (2, 63)), "Q6_K": ((208, 127 * 32),)}


def gguf_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    _, _, i, rest = module.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{i}.{_LAYER[rest]}.{leaf}"


def random_blocks(name: str, n: int, k: int, magnitude: float, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks [N, row bytes] whose values reach about `magnitude`."""
    qtype = BY_NAME[name]
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (n, k // qtype.block_size, qtype.block_bytes), dtype=np.uint8)
    for offset, reach in _K_SCALES[name]:
        scale = (gen.uniform(0.5, 1.0, blocks.shape[:2]) * magnitude / reach).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a Llama q / k projection's rows (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(checkpoint: Path, out: Path, types: dict[str, str], default: str = "Q8_0", seed: int = 0) -> Path:
    """The checkpoint as a GGUF file: each 2-D weight in the type `types` names for its GGUF tensor kind
    (attn_q, ffn_down, token_embd, ...), else `default` (F32 keeps float32); 1-D tensors in float32."""
    import gguf
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = json.loads((checkpoint / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    _write_tokenizer(writer, Tokenizer.from_file(str(checkpoint / "tokenizer.json")), checkpoint, config["vocab_size"])
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for i, (name, w) in enumerate(sorted(tensors.items())):
        target = gguf_name(name)
        if arch == "llama" and ".q_proj." in name or arch == "llama" and ".k_proj." in name:
            w = _permute(w, heads if ".q_proj." in name else kv_heads)
        kind = target.split(".")[-2]
        qname = types.get(kind, default) if w.dim() == 2 else "F32"
        if qname == "F32":
            writer.add_tensor(target, w.float().numpy())
        elif qname in _K_SCALES:
            n, k = w.shape
            writer.add_tensor(target, random_blocks(qname, n, k, float(w.abs().max()), seed + i),
                              raw_dtype=gguf.GGMLQuantizationType[qname])
        else:
            writer.add_tensor(target, quantize(w, qname).data.numpy(), raw_dtype=gguf.GGMLQuantizationType[qname])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_tokenizer(writer, tok, checkpoint: Path, vocab_size: int) -> None:
    """The checkpoint's byte-level BPE as tokenizer.ggml.* (padded to the model's vocabulary with unused
    tokens, as llama.cpp's converter does), its stop ids and chat template."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # unused
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = 3 if token in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    if (template := checkpoint / "chat_template.jinja").exists():
        writer.add_chat_template(template.read_text())
