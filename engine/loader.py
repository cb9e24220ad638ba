"""The one weight loader: safetensors shards (with or without an index) into a model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.registry import model_class

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


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    hf_config = json.loads((path / "config.json").read_text())
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf(hf_config))
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():  # buffers built on meta hold no values yet
        if hasattr(module, "reset_buffers"):
            with torch.device(device):
                module.reset_buffers()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r}")
                target = params[name]
                tensor = f.get_tensor(name)
                if tensor.shape != target.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(dtype))
                loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    return model.eval()
