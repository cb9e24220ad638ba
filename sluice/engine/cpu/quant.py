"""The CPU's quantized linears: csrc/quant_matmul.c over a weight kept in its block format (engine/quant.py).

Two paths, one kernel source built for AVX512-VNNI or for AVX2 (chosen at run time, logged once):

- `int8` (the default): each row of x quantized once per block of 32 (llama.cpp's dot products), int8 products
  summed exactly (VPDPBUSD; VPMADDUBSW + VPMADDWD without it), then scaled in float32. The weight is repacked
  once at load (csrc/quant_repack.h: 16 weight rows interleaved, their scales side by side, as llama.cpp's
  Q4_0x8 / Q8_0x4 / Q4_Kx8 layouts; as many bytes as the file's, Q4_K's and Q5_K's 3% more), so one load feeds
  16 output columns and each row of x's values is broadcast once for all of them, for up to 8 rows of x at a
  time (4 on AVX2). The one-call decoder step (csrc/f32_layers.c) runs the same tiles. It moves logits by x's
  rounding (perplexity within 1% of llama.cpp's on the same file, bench/RESULTS.md), and is faster than
  float32 weights at decode and at prefill; the tiles on the file's own layout (csrc/quant_int8.h, for a
  weight not repacked: tests, benchmarks) are 2-10x slower at one row (RESULTS#quant-kernels).
- `float`: float32 rows times the weight dequantized in registers, a few weight rows and rows of x at a time
  (csrc/quant_blocks.h: exactly the float32 values `QuantizedWeight.dequantize` gives, multiplied in float32):
  the path the loaders' exactness tests hold to transformers' logits.

SLUICE_QUANT_ACTIVATIONS=int8 or float chooses one for every weight, `auto` whichever measures faster at start
(logged).

A weight read into memory (not a file's map) is held once: its kernel's repacked copy, the loaded bytes dropped
(`RepackedWeight`, which unpacks them exactly where something reads them as stored); a GGUF file's mapped pages
are given back instead (`_give_back`).

The LM head of a quantized table (a GGUF file's `output`, or its token embedding where tied) is the same
product over the vocabulary (`QuantLMHead`): float logits, greedy rows screened with int8 activations first
(the float path's tokens, exactly). Without either instruction set (or a C compiler), the weight is
dequantized once and run by F.linear (correct, but the float32 copy costs the memory saved).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import time
from typing import Any

import torch
import torch.nn.functional as F

from sluice.base import envs
from sluice.engine.backend import LMHead
from sluice.engine.cpu.build import _AVX2, _AVX512_VL_VNNI, cpu_flags, load
from sluice.engine.cpu.kernels import _cached
from sluice.engine.quant import BY_NAME, Q8_C, QuantizedWeight, QuantType, dequantized, in_order, one_order
from sluice.engine.sampler import argmax

log = logging.getLogger("sluice.engine")

P, INT, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_PACKED = 0x100  # csrc/quant_repack.h's QR_PACKED: a part's type for its repacked copy


class QuantPart(ctypes.Structure):
    """csrc/quant_blocks.h's quant_part_t: one part of a stacked weight (n rows of row_bytes, GGML type; perm:
    its columns' order, QuantizedWeight.perm, or NULL)."""

    _fields_ = [("w", P), ("row_bytes", L), ("type", INT), ("n", INT), ("perm", P)]


# sluice_quant_linear's arguments (parts, their count, k, x, ldx, m, bias, out, ldo, int8)
QUANT_LINEAR: list[Any] = [ctypes.POINTER(QuantPart), INT, INT, P, L, INT, P, P, L, INT]


@_cached
def library() -> tuple[ctypes.CDLL, str] | None:
    """csrc/quant_matmul.c built for AVX512-VNNI, else for AVX2 (with its instruction set's name), or None."""
    for isa, name in ((_AVX512_VL_VNNI, "AVX512-VNNI"), (_AVX2, "AVX2")):
        lib = load("quant_matmul", isa)
        if lib is not None:
            lib.sluice_quant_linear.restype = INT
            lib.sluice_quant_linear.argtypes = QUANT_LINEAR
            lib.sluice_quant_dequantize.restype = INT
            lib.sluice_quant_dequantize.argtypes = [P, INT, INT, INT, L, P]
            lib.sluice_quant_repack.restype = INT
            lib.sluice_quant_repack.argtypes = [P, INT, INT, INT, L, P]
            lib.sluice_quant_unpack.restype = INT
            lib.sluice_quant_unpack.argtypes = [P, INT, INT, INT, L, P]
            lib.sluice_quant_group_rows.restype = INT
            lib.sluice_quant_repacked_row_bytes.restype = L
            lib.sluice_quant_repacked_row_bytes.argtypes = [INT, INT, L]
            log.info("quantized linears: csrc/quant_matmul.c on %s, %s", name,
                     f"{envs.quant_activations()} activations" if envs.quant_activations() else
                     "int8 activations (every block format repacked at load)")
            return lib, name
    return None


def activations() -> str:
    """`int8` or `float` (see the module's doc): SLUICE_QUANT_ACTIVATIONS's, `auto` the one measured faster;
    unset, int8 where this CPU's tiles take the weights repacked at load (every block format), else float."""
    chosen = envs.quant_activations()
    if chosen is None:
        found = library()
        return "int8" if found and _repacks(found[1]) else "float"
    return _measured() if chosen == "auto" else chosen


def _repacks(isa: str) -> bool:
    """Whether the int8 tiles take weights repacked here (csrc/quant_repack.h; F16C: every AVX2 CPU has it)."""
    return isa.startswith("AVX512") or "f16c" in cpu_flags()


@_cached
def _measured() -> str:
    """`int8` where it runs a decode row's product (a Q4_0 weight of 512 x 1024, one row: one thread) faster than
    `float` here, the two interleaved, the best of a few rounds (logged)."""
    found = library()
    if found is None:
        return "float"
    blocks = torch.randint(0, 256, (512, 32, 18), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blocks[..., :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # (each block's scale)
    weight = QuantizedWeight(blocks.view(512, -1), BY_NAME["Q4_0"], (512, 1024))
    x, best = torch.randn(1, 1024), {"float": float("inf"), "int8": float("inf")}
    lib, isa = found
    kernels = {a: QuantMatmul(lib, isa, (weight,), None, a == "int8") for a in best}
    for _ in range(5):
        for a, kernel in kernels.items():
            t0 = time.perf_counter()
            for _ in range(10):
                kernel(x)
            best[a] = min(best[a], time.perf_counter() - t0)
    choice = "int8" if best["int8"] < best["float"] else "float"
    log.info("quantized linears: %s activations, measured (int8 at %.2fx float's speed at one row)", choice,
             best["float"] / best["int8"])
    return choice


class QuantMatmul:
    """x @ W^T + bias for float32 rows x [..., K] and a quantized weight W [N, K] (never unpacked whole), W
    given as parts stacked on N. With int8 activations each part is repacked once (csrc/quant_repack.h), and
    one read into memory (not a file's map) is then held only so: `parts` gives it as a `RepackedWeight`."""

    def __init__(self, lib: ctypes.CDLL, isa: str, parts: tuple[QuantizedWeight, ...], bias: torch.Tensor | None,
                 int8: bool, repack: bool = True) -> None:
        self.n, self.k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.int8 = int8
        self.isa = f"{isa}, {'int8' if int8 else 'float'} activations"
        self.lib = lib
        # (int8: parts repacked once, csrc/quant_repack.h; the kernel reads only the copy)
        self.packed = [p.packed if isinstance(p, RepackedWeight) else
                       _repacked(lib, p) if repack and int8 and (_repacks(isa) or p.qtype == Q8_C) else None
                       for p in parts]
        self.parts = tuple(p if packed is None or p.mapped or isinstance(p, RepackedWeight)
                           else RepackedWeight(packed, p.qtype, p.shape, p.data.shape[1], p.perm)
                           for p, packed in zip(parts, self.packed))
        # x's columns in the weight's stored order (every part's the same: `build`), or None
        self.perm = None if parts[0].perm is None else parts[0].perm.contiguous()
        perm = None if self.perm is None else self.perm.data_ptr()
        # (what csrc/f32_layers.c's step reads too: pointers into the bytes, which this object keeps)
        self.spec = (QuantPart * len(parts))(*[
            QuantPart(p.data.data_ptr(), p.data.stride(0), p.qtype.ggml, p.shape[0], perm) if packed is None
            else QuantPart(packed.data_ptr(), packed.stride(0), p.qtype.ggml | _PACKED, p.shape[0], perm)
            for p, packed in zip(self.parts, self.packed)])

    @classmethod
    def build(cls, weight: QuantizedWeight | tuple[QuantizedWeight, ...], bias: torch.Tensor | None = None,
              int8: bool | None = None, repack: bool = True) -> "QuantMatmul | None":
        """The kernel for this weight (int8 activations or not: `activations` unless given), or None where it
        cannot run here. With int8 activations, the parts are repacked once (csrc/quant_repack.h)
        unless `repack` is False (their tiles on the file's layout: for tests and benchmarks)."""
        found = library()
        if found is None:
            return None
        lib, isa = found
        parts = (weight,) if isinstance(weight, QuantizedWeight) else tuple(weight)
        if not one_order(parts):
            return None  # (x is read in one order for all the parts)
        int8 = activations() == "int8" if int8 is None else int8
        if any(p.qtype == Q8_C for p in parts):
            if int8 and all(p.qtype == Q8_C for p in parts):
                repack = True  # (the per-channel tiles read only the repacked form)
            elif (blocks := _blocks(parts)) is None:
                return None
            else:
                parts = blocks
        if not (int8 and repack):  # (a weight held repacked, unpacked for the tiles on its own layout)
            parts = tuple(p.stored() if isinstance(p, RepackedWeight) else p for p in parts)
        if any(not isinstance(p, RepackedWeight) and p.data.stride(1) != 1 for p in parts):
            parts = tuple(p if isinstance(p, RepackedWeight) else
                          dataclasses.replace(p, data=p.data.contiguous(), mapped=False) for p in parts)
        return cls(lib, isa, parts, bias, int8, repack)

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
        status = self.lib.sluice_quant_linear(self.spec, len(self.parts), self.k, rows.data_ptr(), rows.stride(0),
                                              rows.shape[0], bias, out.data_ptr(), self.n, int(self.int8))
        if status == -2:
            raise MemoryError("the quantized matmul kernel could not allocate its workspace")
        if status:
            raise ValueError("the quantized matmul kernel refused a part's type")


def _blocks(parts: tuple[QuantizedWeight, ...]) -> tuple[QuantizedWeight, ...] | None:
    """The parts with each per-channel one as Q8_0 blocks of the same values (float activations, or beside
    other kinds: the tiles that run them), or None where float16 cannot hold a scale closely (then dequantized)."""
    from sluice.engine.compressed_tensors import to_blocks

    out = []
    for p in parts:
        found = to_blocks(p.data[:, 4:].view(torch.int8), p.data[:, :4].contiguous().view(torch.float32)) \
            if p.qtype == Q8_C else (p, True)
        if found is None:
            return None
        out.append(found[0])
    return tuple(out)


def _repacked(lib: ctypes.CDLL, weight: QuantizedWeight) -> torch.Tensor:
    """The weight's bytes interleaved for the int8 tiles (csrc/quant_repack.h), its rows padded to whole groups:
    as many bytes a row as the file's (Q4_K / Q5_K: 148 / 180 a super-block for 144 / 176)."""
    n, k = weight.shape
    group = lib.sluice_quant_group_rows()
    row_bytes = lib.sluice_quant_repacked_row_bytes(weight.qtype.ggml, k, weight.data.stride(0))
    out = torch.empty((n + group - 1) // group * group, row_bytes, dtype=torch.uint8)
    if lib.sluice_quant_repack(weight.data.data_ptr(), weight.qtype.ggml, n, k, weight.data.stride(0),
                               out.data_ptr()):
        raise ValueError(f"the repack kernel refused {weight.qtype.name}")
    if weight.mapped:
        _give_back(weight.data)
    return out


class RepackedWeight(QuantizedWeight):
    """A weight held only as its repacked copy (`packed`: the int8 tiles' form, csrc/quant_repack.h), as one read
    into memory is once its kernel is built (a W8A8, GPTQ / AWQ or `--quantization` weight: held once, not as its
    loaded bytes beside the copy). `data`, its bytes as stored, is unpacked from the copy at each read (exactly:
    sluice_quant_unpack), for what reads them so (a float-activation kernel, dequantize, tests)."""

    packed: torch.Tensor
    row_bytes: int

    def __init__(self, packed: torch.Tensor, qtype: QuantType, shape: tuple[int, int], row_bytes: int,
                 perm: torch.Tensor | None = None) -> None:
        for name, value in (("packed", packed), ("qtype", qtype), ("shape", shape), ("mapped", False),
                            ("row_bytes", row_bytes), ("perm", perm)):
            object.__setattr__(self, name, value)

    @property
    def data(self) -> torch.Tensor:
        found = library()
        assert found is not None  # (it repacked this weight)
        n, k = self.shape
        out = torch.empty(n, self.row_bytes, dtype=torch.uint8)
        if found[0].sluice_quant_unpack(self.packed.data_ptr(), self.qtype.ggml, n, k, self.row_bytes,
                                        out.data_ptr()):
            raise ValueError(f"the unpack kernel refused {self.qtype.name}")
        return out

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def stored(self) -> QuantizedWeight:
        """The weight as its bytes are stored (unpacked once: a copy)."""
        return QuantizedWeight(self.data, self.qtype, self.shape, perm=self.perm)


_MADV_DONTNEED = 4


def _give_back(data: torch.Tensor) -> None:
    """Drops this process's resident pages of bytes that lie in a read-only file map, once the kernels read a
    repacked copy: the whole pages inside them (the file's pages stay in the page cache and come back on a read,
    as the LM head's and the embedding's reads of their tables do). A model near the machine's memory would
    otherwise hold each such weight twice."""
    start = data.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + data.numel() * data.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first and _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED):
        log.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())


@_cached
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


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
    logits of the dequantized table, in float32). Each greedy row's argmax is theirs too, found by a screen:
    the int8-activation product over the table, each logit within a bound of its float one (x's rounding, at
    most half a step d / 2 a value, times the weight's L1 norm per block of 32: `_norms`), then the float
    product over only the rows whose bound reaches the best lower bound (a row's float logits are the same
    bits whatever other rows it is computed beside)."""

    _MOST_CANDIDATES = 256  # past it (a flat row, NaNs), the logits of every row

    def __init__(self, weight: QuantizedWeight, kernel: QuantMatmul, screen: QuantMatmul | None) -> None:
        super().__init__(torch.empty(0))
        self.table, self.kernel, self.screen = weight, kernel, screen
        self.norms = None if screen is None else _norms(weight)  # [V, D / 32]
        self.path = (f"Sluice's quantized matmul ({weight.qtype.name}, {kernel.isa})"
                     + (" (greedy rows screened with int8 activations)" if screen else ""))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.screen is None or self.norms is None:
            return argmax(self(hidden))
        rows = hidden.reshape(-1, self.kernel.k).float()
        approx = self.screen(rows)  # [B, V]
        # (each product's float32 rounding, about K 2^-24 of sum |w x| <= 254 times the bound: 8 times that room)
        room = 1 + self.kernel.k * 254 * 2.0**-21
        bound = (rows.view(rows.shape[0], -1, 32).abs().amax(-1) * (room / 254)) @ self.norms.T
        floor = (approx - bound).amax(-1, keepdim=True)
        candidates = (approx + bound >= floor).any(0).nonzero().squeeze(1)
        if not 0 < candidates.numel() <= self._MOST_CANDIDATES:
            return argmax(self(hidden))
        exact = QuantMatmul.build(self.table.rows(candidates), None, int8=False)
        assert exact is not None  # (the table's own kernel runs here)
        return candidates[argmax(exact(rows))]


def _norms(weight: QuantizedWeight, chunk: int = 4096) -> torch.Tensor:
    """Each row's L1 norm of each block of 32 values [N, K / 32] (a chunk of rows dequantized at a time)."""
    n, k = weight.shape
    out = torch.empty(n, k // 32)
    for start in range(0, n, chunk):
        rows = weight.rows(torch.arange(start, min(start + chunk, n)))
        values = dequantize(rows)
        out[start:start + chunk] = (rows.dequantize() if values is None else values).abs().view(-1, k // 32, 32).sum(-1)
    return out


def quant_lm_head(weight: QuantizedWeight) -> LMHead:
    """The LM head of a quantized table on this CPU: `QuantLMHead`, else (no kernel) F.linear over the table
    dequantized once."""
    kernel = QuantMatmul.build(weight, None, int8=False)
    if kernel is None:
        return LMHead(weight.dequantize())
    # (the table's own pages are kept: the float product reads them every step a row is sampled)
    return QuantLMHead(weight, kernel, QuantMatmul.build(dataclasses.replace(weight, mapped=False), None, int8=True))


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
    return in_order(out, weight.perm)
