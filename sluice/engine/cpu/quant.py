"""The CPU's quantized linears: csrc/quant_matmul.c over a weight kept in its block format (engine/quant.py).

Two paths, one kernel source built for AVX512-VNNI or for AVX2 (chosen at run time, logged once):

- `float` (the default): float32 rows times the weight dequantized in registers, a few weight rows and rows of
  x at a time (csrc/quant_blocks.h: exactly the float32 values `QuantizedWeight.dequantize` gives, multiplied
  in float32). The one-call decoder step (csrc/f32_layers.c) runs the same product, so a quantized model's
  decode step is one call as a float32 one's is.
- `int8`: each row of x quantized per block of 32 (llama.cpp's dot products), int8 products summed exactly
  (VPDPBUSD; VPMADDUBSW + VPMADDWD on AVX2), then scaled in float32. On the trained SmolLM2-135M Q4_1 file it
  changes the greedy answer (the MLP's int8-rounded inputs alone do), so it waits on the perplexity comparison
  of issue 38 before it becomes a default; SLUICE_QUANT_ACTIVATIONS=int8 chooses it (op by op).

The LM head of a quantized table (a GGUF file's `output`, or its token embedding where tied) is the same
product over the vocabulary (`QuantLMHead`). Without either instruction set (or a C compiler), the weight is
dequantized once and run by F.linear (correct, but the float32 copy costs the memory saved).
"""
from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from sluice.base import envs
from sluice.engine.backend import LMHead
from sluice.engine.cpu.build import _AVX2, _AVX512_VL_VNNI, load
from sluice.engine.cpu.kernels import _cached
from sluice.engine.quant import QuantizedWeight, dequantized

log = logging.getLogger("sluice.engine")

P, INT, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


class QuantPart(ctypes.Structure):
    """csrc/quant_blocks.h's quant_part_t: one part of a stacked weight (n rows of row_bytes, GGML type)."""

    _fields_ = [("w", P), ("row_bytes", L), ("type", INT), ("n", INT)]


@_cached
def library() -> tuple[ctypes.CDLL, str] | None:
    """csrc/quant_matmul.c built for AVX512-VNNI, else for AVX2 (with its instruction set's name), or None."""
    for isa, name in ((_AVX512_VL_VNNI, "AVX512-VNNI"), (_AVX2, "AVX2")):
        lib = load("quant_matmul", isa)
        if lib is not None:
            lib.sluice_quant_linear.restype = INT
            lib.sluice_quant_linear.argtypes = [ctypes.POINTER(QuantPart), INT, INT, P, L, INT, P, P, L]
            lib.sluice_quant_matmul_int8.restype = INT
            lib.sluice_quant_matmul_int8.argtypes = [P, INT, INT, INT, L, P, L, INT, P, P, L]
            lib.sluice_quant_dequantize.restype = INT
            lib.sluice_quant_dequantize.argtypes = [P, INT, INT, INT, L, P]
            log.info("quantized linears: csrc/quant_matmul.c on %s, %s activations", name, activations())
            return lib, name
    return None


def activations() -> str:
    """`int8` or `float` (see the module's doc)."""
    return envs.quant_activations() or "float"


class QuantMatmul:
    """x @ W^T + bias for float32 rows x [..., K] and a quantized weight W [N, K] (never unpacked whole), W
    given as parts stacked on N."""

    def __init__(self, lib: ctypes.CDLL, isa: str, parts: tuple[QuantizedWeight, ...], bias: torch.Tensor | None,
                 int8: bool) -> None:
        self.parts = parts
        self.n, self.k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.int8 = int8
        self.isa = f"{isa}, {'int8' if int8 else 'float'} activations"
        self.lib = lib
        # (what csrc/f32_layers.c's step reads too: pointers into the parts' bytes, which this object keeps)
        self.spec = (QuantPart * len(parts))(*[QuantPart(p.data.data_ptr(), p.data.stride(0), p.qtype.ggml,
                                                         p.shape[0]) for p in parts])

    @classmethod
    def build(cls, weight: QuantizedWeight | tuple[QuantizedWeight, ...], bias: torch.Tensor | None = None,
              int8: bool | None = None) -> "QuantMatmul | None":
        """The kernel for this weight (int8 activations or not: `activations()` unless given), or None where it
        cannot run here."""
        found = library()
        if found is None:
            return None
        lib, isa = found
        parts = (weight,) if isinstance(weight, QuantizedWeight) else tuple(weight)
        if any(p.data.stride(1) != 1 for p in parts):
            parts = tuple(QuantizedWeight(p.data.contiguous(), p.qtype, p.shape) for p in parts)
        return cls(lib, isa, parts, bias, activations() == "int8" if int8 is None else int8)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.k).float()
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        if out.numel():
            self._run(rows, out)
        return out.view(*x.shape[:-1], self.n).to(x.dtype)

    def _run(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        bias = None if self.bias is None else self.bias.data_ptr()
        if not self.int8:
            if self.lib.sluice_quant_linear(self.spec, len(self.parts), self.k, rows.data_ptr(), rows.stride(0),
                                            rows.shape[0], bias, out.data_ptr(), self.n):
                raise ValueError("the quantized matmul kernel refused a part's type")
            return
        start = 0
        for part in self.parts:
            n, data = part.shape[0], part.data
            if self.lib.sluice_quant_matmul_int8(data.data_ptr(), part.qtype.ggml, n, self.k, data.stride(0),
                                                 rows.data_ptr(), rows.stride(0), rows.shape[0],
                                                 None if bias is None else bias + 4 * start,
                                                 out.data_ptr() + 4 * start, self.n):
                raise MemoryError("the quantized matmul kernel could not allocate its workspace")
            start += n


class DequantizedLinear:
    """The fallback where no kernel runs: the weight dequantized once, F.linear."""

    isa = "dequantized, F.linear"

    def __init__(self, parts: tuple[QuantizedWeight, ...], bias: torch.Tensor | None) -> None:
        self.weight, self.bias = dequantized(parts), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def quant_linear(parts: QuantizedWeight | tuple[QuantizedWeight, ...],
                 bias: torch.Tensor | None) -> QuantMatmul | DequantizedLinear:
    """What runs a quantized linear (parts stacked on its outputs) on this CPU."""
    parts = (parts,) if isinstance(parts, QuantizedWeight) else tuple(parts)
    return QuantMatmul.build(parts, bias) or DequantizedLinear(parts, bias)


class QuantLMHead(LMHead):
    """The LM head of a table kept quantized [V, D]: the float-activation product over the vocabulary (the
    logits of the dequantized table, in float32), each greedy row's argmax taken from them."""

    def __init__(self, weight: QuantizedWeight, kernel: QuantMatmul) -> None:
        super().__init__(torch.empty(0))
        self.table, self.kernel = weight, kernel
        self.path = f"Sluice's quantized matmul ({weight.qtype.name}, {kernel.isa})"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden)


def quant_lm_head(weight: QuantizedWeight) -> LMHead:
    """The LM head of a quantized table on this CPU: `QuantLMHead`, else (no kernel) F.linear over the table
    dequantized once."""
    kernel = QuantMatmul.build(weight, None, int8=False)
    return LMHead(weight.dequantize()) if kernel is None else QuantLMHead(weight, kernel)


def dequantize(weight: QuantizedWeight) -> torch.Tensor | None:
    """The weight's float32 values [N, K] as the kernel computes them, or None where it cannot run here."""
    found = library()
    if found is None:
        return None
    out = torch.empty(weight.shape, dtype=torch.float32)
    data = weight.data if weight.data.stride(1) == 1 else weight.data.contiguous()
    if out.numel() and found[0].sluice_quant_dequantize(data.data_ptr(), weight.qtype.ggml, *weight.shape,
                                                        data.stride(0), out.data_ptr()):
        raise MemoryError("the dequantize kernel could not allocate its workspace")
    return out
