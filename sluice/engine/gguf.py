"""A GGUF file's weights into a model (the loader's branch for sluice/gguf_checkpoint.py's directories).

The file is memory-mapped (gguf.GGUFReader); each linear, the token embedding and the LM head whose GGUF
tensor has a block format the kernels read (engine/quant.py) keep those bytes where they lie in the map, so
the model's resident memory is about the file's own (the embedding dequantizes the rows it looks up, the LM
head multiplies by the table as it lies). Other tensors (norms, tables of other types) are dequantized to the
model's dtype. On a device other than the CPU every tensor is dequantized.

Q5_0 and Q5_1, which llama-quantize writes for rows whose length is not a multiple of 256 (a Q4_K_M / Q5_K_M
file of a model of hidden size 576, SmolLM2's, or 896, Qwen2.5-0.5B's), are kernel formats like the others.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (its rotary pairs
interleaved); they are put back in Hugging Face's order here, as transformers' GGUF loader does.
"""
from __future__ import annotations

import json
import logging
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from sluice.base.gguf_checkpoint import ROPE_FREQS, gguf_file
from sluice.engine.layers import Embedding, Linear, stacked_parts
from sluice.engine.loader import empty_model
from sluice.engine.quant import QUANT_TYPES, QuantizedWeight, dequantized, set_quantized

log = logging.getLogger("sluice.engine")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    or None for one no model here reads."""
    if m := _BLOCK.fullmatch(name):
        module = _LAYER.get(m[2])
        return None if module is None else f"model.layers.{m[1]}.{module}.{m[3]}"
    module, _, leaf = name.rpartition(".")
    return f"{_GLOBAL[module]}.{leaf}" if module in _GLOBAL else None


def load_gguf_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from gguf import GGUFReader

    hf_config = json.loads((path / "config.json").read_text())
    file = gguf_file(path)
    model = empty_model(hf_config, dtype, device)
    reader = GGUFReader(str(file), "r")
    tensors = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # (read into config.json's rope_scaling: sluice/base/gguf_checkpoint.py)
            continue
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"{file}: tensor {t.name!r} is not one this model reads")
        tensors[name] = t
    permute = _llama_permutation(hf_config)
    modules = dict(model.named_modules())
    kinds: Counter = Counter()
    consumed: set[str] = set()
    for name, target in dict(model.named_parameters()).items():
        used = [name] if name in tensors else stacked_parts(name)
        if not used or any(p not in tensors for p in used):
            raise ValueError(f"{file} lacks the tensor(s) of {name!r}")
        consumed.update(used)
        parts = [_quantized(tensors[p], permute.get(p)) for p in used] if device.type == "cpu" else [None]
        module = modules[name.rpartition(".")[0]]
        if (device.type == "cpu" and (isinstance(module, (Linear, Embedding)) or name == "lm_head.weight")
                and name.endswith(".weight") and all(q is not None for q in parts)):
            set_quantized(module, tuple(parts))  # type: ignore[arg-type]
            kinds.update(tensors[p].tensor_type.name for p in used)
            continue
        tensor = torch.cat([_float(tensors[p], permute.get(p)) for p in used])
        kinds.update(f"{tensors[p].tensor_type.name} (as {str(dtype)[6:]})" for p in used)
        if tensor.shape != target.shape:
            raise ValueError(f"{name}: GGUF shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
    if unused := sorted(set(tensors) - consumed):
        raise ValueError(f"{file} has tensors the model does not use: {unused[:5]}")
    log.info("GGUF %s: %s", file.name, ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    return model.eval()


def _llama_permutation(hf_config: dict) -> dict[str, int]:
    """The q / k projections whose rows llama.cpp permuted, and each one's head count (Llama only)."""
    if hf_config["model_type"] != "llama":
        return {}
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    return {f"model.layers.{i}.self_attn.{proj}.{leaf}": n for i in range(hf_config["num_hidden_layers"])
            for proj, n in (("q_proj", heads), ("k_proj", kv_heads)) for leaf in ("weight", "bias")}


def _unpermute(rows: torch.Tensor, heads: int | None) -> torch.Tensor:
    """Rows [N, ...] in Hugging Face's order from llama.cpp's (each head's two rotary halves interleaved)."""
    if heads is None:
        return rows
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # (the map is read-only, and nothing writes to it)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _quantized(t, heads: int | None) -> QuantizedWeight | None:
    """The tensor's bytes as a quantized weight (in place in the map unless its rows are permuted), or None where
    its type is not one the kernels read."""
    if len(t.shape) != 2 or (qtype := QUANT_TYPES.get(int(t.tensor_type))) is None:
        return None
    k, n = (int(d) for d in t.shape)
    return QuantizedWeight(_unpermute(_tensor(t.data), heads), qtype, (n, k), mapped=heads is None)


def _exact(t) -> np.ndarray:
    """The tensor's float32 values as llama.cpp defines them (the gguf package's dequantization)."""
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)


def _float(t, heads: int | None) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(t.shape))
    if int(t.tensor_type) in QUANT_TYPES and (q := _quantized(t, None)) is not None:
        values = dequantized((q,))
    else:
        values = _tensor(_exact(t))  # (read only where F32: the map's own)
    return _unpermute(values.reshape(shape), heads)
