"""Weights kept in GGUF's block formats: what a quantized linear holds, whatever backend runs it.

A `QuantizedWeight` is the bytes of a weight [N, K] as GGUF stores them (row n: K / block_size blocks of
`block_bytes`), held as they are (a memory map of the file, or the result of `quantize`); a backend's kernel
multiplies rows by it (engine/cpu/quant.py), and `dequantize` gives its float32 values (the reference, and
the path of a backend without a kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml: int  # GGMLQuantizationType's value (Q8_C: not a GGUF type, csrc/quant_channel.h's code)
    block_size: int
    block_bytes: int
    row_head: int = 0  # bytes before a row's blocks (Q8_C: its float32 scale)


QUANT_TYPES = {t.ggml: t for t in (
    QuantType("Q4_0", 2, 32, 18),
    QuantType("Q4_1", 3, 32, 20),
    QuantType("Q5_0", 6, 32, 22),
    QuantType("Q5_1", 7, 32, 24),
    QuantType("Q8_0", 8, 32, 34),
    QuantType("Q4_K", 12, 256, 144),
    QuantType("Q5_K", 13, 256, 176),
    QuantType("Q6_K", 14, 256, 210),
)}
BY_NAME = {t.name: t for t in QUANT_TYPES.values()}
# per-channel int8 (compressed-tensors' W8A8): a row's float32 scale, then its K int8 values, w = scale * q
Q8_C = QuantType("Q8_C", 64, 32, 32, row_head=4)


@dataclass(frozen=True)
class QuantizedWeight:
    data: torch.Tensor  # uint8 [N, K / block_size * block_bytes]
    qtype: QuantType
    shape: tuple[int, int]  # (N, K)
    mapped: bool = False  # data lies in a read-only map of a file (a GGUF file's): its pages may be given back
    # the columns' order as stored (None: as x's): column c of the blocks is column perm[c] of the weight and of
    # x, int32 [K] (a GPTQ act-order weight, its columns sorted by group so that each block lies in one)
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if k % self.qtype.block_size:
            raise ValueError(f"{self.qtype.name}: K = {k} is not a multiple of {self.qtype.block_size}")
        if tuple(self.data.shape) != (n, self.qtype.row_head + k // self.qtype.block_size * self.qtype.block_bytes):
            raise ValueError(f"{self.qtype.name} bytes {tuple(self.data.shape)} do not hold a [{n}, {k}] weight")
        if self.perm is not None and (self.perm.dtype != torch.int32 or tuple(self.perm.shape) != (k,)):
            raise ValueError(f"a column order for a [{n}, {k}] weight is int32 [{k}], not {self.perm.dtype} "
                             f"{tuple(self.perm.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The rows `index` [T] (an embedding lookup's: only those rows' bytes, still quantized)."""
        return QuantizedWeight(self.data.index_select(0, index), self.qtype, (index.numel(), self.shape[1]),
                               perm=self.perm)

    def dequantize(self) -> torch.Tensor:
        """The float32 values [N, K] (through the gguf package: llama.cpp's definitions; Q8_C's scale * q), in
        x's column order."""
        if self.qtype == Q8_C:
            values = self.data[:, 4:].view(torch.int8).float() * self.data[:, :4].contiguous().view(torch.float32)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            found = dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype.ggml))
            values = torch.from_numpy(np.ascontiguousarray(found, dtype=np.float32)).reshape(self.shape)
        return in_order(values, self.perm)


def one_order(parts: tuple[QuantizedWeight, ...] | list[QuantizedWeight]) -> bool:
    """Whether the parts (a stacked projection's) read x in one column order: every perm None, or all equal."""
    first = parts[0].perm
    return all((p.perm is None) == (first is None) and (first is None or torch.equal(p.perm, first)) for p in parts)


def in_order(values: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """A weight's values [N, K] stored in `perm`'s column order (QuantizedWeight.perm) in x's order."""
    if perm is None:
        return values
    out = torch.empty_like(values)
    out[:, perm.long()] = values
    return out


def channel_int8(weight: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """An int8 weight [N, K] and its float32 scale a row [N] as Q8_C."""
    rows = torch.cat([scale.float().reshape(-1, 1).contiguous().view(torch.uint8), weight.view(torch.uint8)], dim=1)
    return QuantizedWeight(rows.contiguous(), Q8_C, tuple(weight.shape))


def quantize(weight: torch.Tensor, name: str) -> QuantizedWeight:
    """A float weight [N, K] in one of the block formats the gguf package quantizes to (Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1: not the K-quants), as llama.cpp's reference quantization rounds it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype = BY_NAME[name]
    values = weight.detach().float().contiguous().numpy()
    data = gguf_quantize(values, GGMLQuantizationType(qtype.ggml))
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(data)), qtype, tuple(weight.shape))


def set_quantized(layer: nn.Module, parts: tuple[QuantizedWeight, ...]) -> None:
    """Makes `layer` (a linear, the LM head or an embedding table [V, D]) hold quantized weights in place of its
    float one: `parts` stacked on the output dimension (a stacked projection's parts may have different types,
    as Q4_K_M files' attn_v and attn_q do). The backend's `linear` then runs them (see `Linear.quant`), the
    embedding dequantizes the rows it looks up (`Embedding.quant`) and the LM head multiplies by the table
    (`CausalLM.lm_weight`); the float weight becomes an empty placeholder."""
    n, k = tuple(layer.weight.shape)
    if sum(p.shape[0] for p in parts) != n or any(p.shape[1] != k for p in parts):
        raise ValueError(f"quantized parts {[p.shape for p in parts]} for a {(n, k)} linear")
    layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
    layer.quant = tuple(parts)


def dequantized(parts: tuple[QuantizedWeight, ...]) -> torch.Tensor:
    """Stacked parts' float32 values [N, K]."""
    return torch.cat([p.dequantize() for p in parts])


# --quantization's choices -> the block format each quantizes a layer's linear to
AT_LOAD = {"int8": "Q8_0", "q4": "Q4_0"}
# ... and the embedding and the LM head (llama.cpp's quantizer too keeps them wider than a 4-bit layer)
TABLES_AT_LOAD = "Q8_0"


def quantize_linears(model: nn.Module, choice: str) -> int:
    """Quantizes every float linear of the model's layers (engine.layers.Linear) whose K is whole blocks to
    `AT_LOAD[choice]`, and the embedding table and the LM head to `TABLES_AT_LOAD` (one table where they are
    tied); returns how many. `none` changes nothing."""
    from sluice.engine.layers import CausalLM, Embedding, Linear

    if choice == "none":
        return 0
    done, tables = 0, isinstance(model, CausalLM)  # (whose `lm_weight` gives the LM head its table)
    for name, module in model.named_modules():
        table = tables and (isinstance(module, Embedding) or name == "lm_head")
        weight = module.weight if isinstance(module, Linear) or table else None
        if (weight is None or getattr(module, "quant", None) is not None or weight.device.type != "cpu"
                or weight.dim() != 2 or weight.shape[1] % 32):
            continue
        set_quantized(module, (quantize(weight, TABLES_AT_LOAD if table else AT_LOAD[choice]),))
        done += 1
    return done
