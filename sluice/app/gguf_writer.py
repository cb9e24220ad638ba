"""A Llama-family checkpoint directory (sluice/builtin_models.py's tiny ones) written as one GGUF file, as
llama.cpp's converter lays it out, its linears in chosen block formats: for tests and benchmarks of the GGUF
path (sluice/gguf_checkpoint.py, engine/gguf.py).

A `llama3` rope_scaling is written as llama.cpp's converter writes it: only a `rope_freqs.weight` tensor of
per-frequency factors (no rope.scaling.* keys). A checkpoint with a SentencePiece `tokenizer.model` has it
written as tokenizer.ggml.model `llama` (pieces, scores, token types, as llama.cpp writes it), else its
tokenizer.json's byte-level BPE as `gpt2`.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are the checkpoint's weights quantized by the gguf package. The gguf package cannot
quantize to the K-quants, so a Q4_K / Q5_K / Q6_K tensor holds random blocks of about the weight's
magnitude instead (the file is then its own model: a reference reads the file, not the checkpoint).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sluice.base.gguf_checkpoint import ROPE_FREQS, llama3_factors
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
    if (checkpoint / "tokenizer.model").exists():
        _write_sentencepiece(writer, checkpoint, config["vocab_size"])
    else:
        _write_tokenizer(writer, Tokenizer.from_file(str(checkpoint / "tokenizer.json")), checkpoint,
                         config["vocab_size"])
    if (scaling := config.get("rope_scaling")) and scaling.get("rope_type", scaling.get("type")) == "llama3":
        writer.add_tensor(ROPE_FREQS, np.array(llama3_factors(
            config["rope_theta"], config["head_dim"], scaling["factor"], scaling.get("low_freq_factor", 1.0),
            scaling.get("high_freq_factor", 4.0), scaling.get("original_max_position_embeddings", 8192)),
            dtype=np.float32))
    elif scaling:
        raise ValueError(f"rope scaling {scaling} is not written here (only llama3)")
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
        elif qname in BY_NAME:
            writer.add_tensor(target, quantize(w, qname).data.numpy(), raw_dtype=gguf.GGMLQuantizationType[qname])
        else:  # (a type no kernel reads: the gguf package's quantization of it)
            qtype = gguf.GGMLQuantizationType[qname]
            writer.add_tensor(target, gguf.quants.quantize(w.float().numpy(), qtype), raw_dtype=qtype)
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


def _write_sentencepiece(writer, checkpoint: Path, vocab_size: int) -> None:
    """The checkpoint's SentencePiece model as tokenizer.ggml.* (tokenizer.ggml.model `llama`): each piece, its
    score and its type (SentencePiece's own numbering, as llama.cpp's converter writes it), padded to the
    model's vocabulary with unused pieces; its special ids, stop ids and chat template."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString((checkpoint / "tokenizer.model").read_bytes())
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    pieces += [(f"[PAD{i}]", -1000.0, 5) for i in range(len(pieces), vocab_size)]
    spec, normalizer = proto.trainer_spec, proto.normalizer_spec
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p for p, _, _ in pieces])
    writer.add_token_scores([s for _, s, _ in pieces])
    writer.add_token_types([t for _, _, t in pieces])
    writer.add_add_space_prefix(normalizer.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(normalizer.remove_extra_whitespaces)
    writer.add_unk_token_id(spec.unk_id)
    if spec.bos_id >= 0:
        writer.add_bos_token_id(spec.bos_id)
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if (template := checkpoint / "chat_template.jinja").exists():
        writer.add_chat_template(template.read_text())
