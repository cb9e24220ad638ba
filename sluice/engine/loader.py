"""The one weight loader: safetensors shards (with or without an index) into a model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from sluice.base.gguf_checkpoint import is_gguf_checkpoint
from sluice.engine import compressed_tensors, gptq, gptq_config
from sluice.engine.layers import Embedding, Linear, stacked_parts
from sluice.engine.models.registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def empty_model(hf_config: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of an HF config, its parameters allocated (not filled) and its buffers built."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf(hf_config))
    # to_empty's empty_like on meta tensors imports sympy (0.4 s of every start): plain contiguous empties instead
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)).to(dtype)
    for module in model.modules():  # buffers built on meta hold no values yet
        if hasattr(module, "reset_buffers"):
            with torch.device(device):
                module.reset_buffers()
    return model


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str = "none") -> torch.nn.Module:
    """The checkpoint's model, its linears quantized at load where `quantization` asks (engine/quant.py)."""
    if is_gguf_checkpoint(path):  # one GGUF file's weights, kept in their block formats (engine/gguf.py)
        from sluice.engine.gguf import load_gguf_model

        model = load_gguf_model(path, dtype, device)
    else:
        model = _load_safetensors(path, dtype, device)
    if quantization != "none":
        from sluice.engine.quant import quantize_linears

        quantize_linears(model, quantization)
    return model


def _load_safetensors(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    hf_config = json.loads((path / "config.json").read_text())
    # GPTQ / AWQ int4 linears (engine/gptq.py), compressed-tensors int8 ones (engine/compressed_tensors.py);
    # refuses what it cannot read
    packed = gptq_config.scheme(hf_config)
    reader: gptq.Reader | compressed_tensors.Reader | None = None
    if isinstance(packed, gptq_config.Int8Scheme):
        reader = compressed_tensors.Reader(packed, device)
    elif packed is not None:
        reader = gptq.Reader(packed, device)
    model = empty_model(hf_config, dtype, device)
    params = dict(model.named_parameters())
    # A bf16 checkpoint served in float32 on the CPU: its linears', embeddings' and LM head's weights stay bf16
    # (the CPU backend packs them in bf16 and widens them in registers: the same values), so loading peaks at the
    # checkpoint's size, not twice it (torch.empty's float32 buffers are never written, never resident).
    narrow = device.type == "cpu" and dtype == torch.float32
    files = {name: file for file in checkpoint_files(path) for name in _tensor_names(file)}
    handles: dict[Path, Any] = {}

    def stored(name: str) -> torch.Tensor:
        file = files[name]  # KeyError: the checkpoint has no such tensor
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(name)

    def fetch(name: str) -> torch.Tensor:
        """A tensor; a quantized linear's weight (one a model reads itself: a mixture's expert) dequantized."""
        if reader is not None and name.endswith(".weight") and (
                found := reader.float_weight(name.removesuffix(".weight"), files.__contains__, stored)) is not None:
            consumed.update(found[1])
            return found[0]
        return stored(name)

    consumed = {n for n in files if n.endswith(_IGNORED_SUFFIXES)}
    for name, target in params.items():
        if reader is not None and (found := reader.linear(model, name, files.__contains__, stored)) is not None:
            tensor, used = found
            if tensor is None:  # the layer holds its weight in a block format now
                consumed.update(used)
                continue
        elif name in files:
            tensor, used = fetch(name), [name]
        elif (parts := stacked_parts(name)) and all(p in files for p in parts):
            tensor, used = torch.cat([fetch(p) for p in parts]), parts
        elif hasattr(model, "load_param"):  # a model-specific encoding (e.g. MXFP4 experts)
            try:
                tensor, used = model.load_param(name, fetch, dtype)
            except KeyError:
                raise ValueError(f"checkpoint {path} lacks {name!r}") from None
        else:
            raise ValueError(f"checkpoint {path} lacks {name!r}")
        if tensor.shape != target.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            if narrow and tensor.dtype == torch.bfloat16 and target.dtype == torch.float32 and (
                    name == "lm_head.weight" or isinstance(owner := model.get_submodule(name.rpartition(".")[0]),
                                                           (Linear, Embedding)) and target is owner.weight):
                target.data = tensor.contiguous()  # (kept in bf16: the float32 buffer never written)
            else:
                target.copy_(tensor.to(target.dtype))  # (the model's dtype, but where a model keeps float32)
        consumed.update(used)
    if hasattr(model, "unused_tensors"):  # tensors a model knows it does not run (DeepSeek's MTP layers)
        consumed.update(model.unused_tensors(set(files) - consumed))
    unexpected = sorted(set(files) - consumed)
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensors the model does not use: {unexpected[:5]}")
    if reader is not None:
        reader.summary(dtype)
    return model.eval()


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())
