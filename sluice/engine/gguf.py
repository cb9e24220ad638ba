"""A GGUF file's weights into a model (the loader's branch for sluice/gguf_checkpoint.py's directories).

The file is memory-mapped (gguf.GGUFReader); each linear, the token embedding and the LM head whose GGUF
tensor has a block format the kernels read (engine/quant.py) keep those bytes where they lie in the map, so
the model's resident memory is about the file's own (the embedding dequantizes the rows it looks up, the LM
head multiplies by the table as it lies). Other tensors (norms, tables of other types) are dequantized to the
model's dtype. On a device other than the CPU every tensor is dequantized.

Q5_0 and Q5_1, which llama-quantize writes for rows whose length is not a multiple of 256 (a Q4_K_M / Q5_K_M
file of a model of hidden size 576, SmolLM2's), have no kernel: they are repacked at load into Q8_0 blocks
(34 bytes for Q5_x's 22 / 24: the file's memory map is not used for them). Q5_0 (d * (q - 16), q in 0..31)
is exactly a Q8_0 block with the same float16 d and the int8 q - 16. Q5_1 (d * q + m) has no exact home
among the kernels' formats: its offset m is no integer multiple of d in general (Q8_0, Q4_0 hold d * q
only), and Q4_1, which has a float16 offset, has 4-bit q. It is requantized to Q8_0 from its exact values,
to the nearest step, adding an error of at most half a Q8_0 step (about the block's largest |value| / 254;
where the block's values span zero, as a weight's do, its 32 levels' 31 d bound that, and the error is an
eighth of Q5_1's own step d or less).

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
from sluice.engine.quant import BY_NAME, QUANT_TYPES, QuantizedWeight, dequantized, set_quantized

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
            kinds.update(_kind(tensors[p]) for p in used)
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


def _kind(t) -> str:
    name = t.tensor_type.name
    return f"{name} (as Q8_0)" if name in _REPACKED else name


def _q5_0(values: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [..., 22] (float16 d first) and their values [..., 32] as Q8_0 blocks [..., 34] of the same
    values: d as it is, q - 16 (recovered exactly: d * (q - 16) is exact in float32) as int8."""
    d = raw[..., :2]
    scale = d.copy().view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale != 0, np.rint(values / scale), 0).astype(np.int8)
    return np.concatenate([d, q.view(np.uint8)], axis=-1)


def _q5_1(values: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Q5_1 blocks' values [..., 32] requantized to Q8_0 blocks [..., 34]: d = the block's largest |value| / 127
    in float16, q = the nearest integer to value / d (llama.cpp's reference divides by d before its float16
    rounding; by the stored d, the error is at most half of it)."""
    d = (np.abs(values).max(axis=-1, keepdims=True) / 127).astype(np.float16)
    scale = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(values / scale), 0).clip(-127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)


_REPACKED = {"Q5_0": (_q5_0, 22), "Q5_1": (_q5_1, 24)}  # -> (to Q8_0, the type's block bytes)


def _quantized(t, heads: int | None) -> QuantizedWeight | None:
    """The tensor's bytes as a quantized weight (in place in the map unless its rows are permuted or it is
    repacked), or None where its type is not one the kernels read or that repacks into one."""
    if len(t.shape) != 2:
        return None
    k, n = (int(d) for d in t.shape)
    if (qtype := QUANT_TYPES.get(int(t.tensor_type))) is not None:
        return QuantizedWeight(_unpermute(_tensor(t.data), heads), qtype, (n, k), mapped=heads is None)
    if (repack := _REPACKED.get(t.tensor_type.name)) is None:
        return None
    to_q8_0, block_bytes = repack
    raw = np.asarray(t.data).reshape(n, k // 32, block_bytes)
    data = to_q8_0(_exact(t).reshape(n, k // 32, 32), raw).reshape(n, -1)
    return QuantizedWeight(_unpermute(torch.from_numpy(data), heads), BY_NAME["Q8_0"], (n, k))


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
