"""The CPU kernels' linears: a packed weight and the calls that read it.

- `F32Matmul` (csrc/f32_matmul.c, AVX-512F; csrc/f32_matmul_avx2.c on CPUs with AVX2 and FMA only, the same
  results): float32 rows against a bf16 or float32 weight, every linear and the LM head of a model served in
  float32. A bf16 weight is widened in registers (exact), so a bf16 checkpoint served in float32 reads half
  the bytes of its float32 copy for the same products.
- `Bf16Matmul` (csrc/bf16_matmul.c, AVX512-BF16): bf16 rows against a bf16 weight (VDPBF16PS).
- `Int8Argmax` (csrc/int8_argmax.c, AVX512-VNNI; csrc/f32_int8_argmax.c, AVX512-VNNI or else AVX2): greedy rows of
  the bf16 or float32 LM head screened in int8.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from sluice.engine.cpu import kernels, ops
from sluice.engine.cpu.kernels import padded, pair_tile_rows, pair_tiles, tile_rows, tiles

log = logging.getLogger("sluice.engine")


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether a float32 tensor's values are all bf16 values (a bf16 checkpoint loaded in float32)."""
    if weight.dtype != torch.float32:
        return False
    bits = weight.detach().contiguous().view(torch.int32)
    return not any(bool((part & 0xFFFF).any()) for part in bits.reshape(-1).split(1 << 24))


def narrowed(weight: torch.Tensor) -> torch.Tensor:
    """The weight in bf16 where that is exact (the same values, half the bytes), else itself."""
    return weight.detach().bfloat16() if bf16_exact(weight) else weight.detach()


class F32Matmul:
    """csrc/f32_matmul.c for one weight [N, K] (bf16 or float32, K even) and optional bias [N]: x @ W^T + bias
    in float32 for float32 rows x [M, K] (any M), or each row's argmax over N without writing the product.
    The weight is packed once: bf16 as tiles of [K/2][16][2] (Bf16Matmul's layout), float32 as
    [K/2][2][16]. On AVX-512F and AVX2 each output is one float32 multiply-add chain over k in order (the same
    bits on both); on AMX (a bf16 weight, K a multiple of 32: csrc/f32_matmul.c) the rows are split into three
    bf16 parts whose products are exact, summed in float32: the same math up to the order of the sums. On
    every path a row's values do not depend on its batch or the threads."""

    AMX = 2  # the kernels' `bf16` argument for a bf16 weight run on AMX

    def __init__(self, lib, isa: str, weight: torch.Tensor, bias: torch.Tensor | None, amx: bool = False) -> None:
        self.n, self.k = weight.shape
        self.bf16 = weight.dtype == torch.bfloat16
        # what the kernels' `bf16` argument says: 0 float32, 1 bf16, AMX a bf16 weight on the tile unit
        self.mode = self.AMX if amx and self.bf16 and self.k % 32 == 0 else int(self.bf16)
        # "AMX" or "AVX-512F" (f32_layers.c, whose fused step reads the same packed weight), or "AVX2"
        self.isa = "AMX" if self.mode == self.AMX else isa
        self.packed = tiles(weight.detach(), 2) if self.bf16 else pair_tiles(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.fn = lib.sluice_f32_matmul
        # SwiGLU in the product's epilogue (gate rows, then up rows, each half whole groups of 64 columns)
        self._swiglu = getattr(lib, "sluice_f32_matmul_swiglu", None) if self.n % 128 == 0 else None

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, amx: bool = True) -> "F32Matmul | None":
        """The kernel for this weight, or None where it does not apply (not a bf16 / float32 CPU weight, odd
        K) or cannot run (see `sluice.engine.cpu.build.load`): AMX's for a bf16 weight whose K is a multiple of 32
        where the CPU has AMX (and `amx`), else AVX-512F's where the CPU has it, else AVX2's."""
        if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32)
                or weight.dim() != 2 or weight.shape[1] % 2 or not weight.shape[1]):
            return None
        if (lib := kernels.f32_layers()) is not None:
            return cls(lib, "AVX-512F", weight, bias, amx and kernels.f32_amx())
        if (lib := kernels.f32_matmul_avx2()) is not None:
            return cls(lib, "AVX2", weight, bias)
        return None

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows `index` [T] as packed (bf16 or float32) [T, K]: a tied embedding's lookups."""
        return tile_rows(self.packed, index) if self.bf16 else pair_tile_rows(self.packed, index)

    def _run(self, x: torch.Tensor, out: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
        bias = None if self.bias is None or out is None else self.bias.data_ptr()
        if self.fn(self.packed.data_ptr(), self.mode, self.n, self.k, x.data_ptr(), x.stride(0), x.shape[0], bias,
                   None if out is None else out.data_ptr(), self.n, None if tokens is None else tokens.data_ptr()):
            raise MemoryError("the float32 matmul kernel could not allocate its workspace")

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as the kernel reads it: float32 rows [M, K], unit stride along K."""
        rows = x.reshape(-1, self.k).float()
        return rows if rows.stride(1) == 1 else rows.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        out = torch.empty(*x.shape[:-1], self.n, dtype=torch.float32)
        if out.numel():
            self._run(rows, out, None)
        return out

    @property
    def swiglu_fused(self) -> bool:
        """Whether `swiglu` runs in the product's epilogue (f32_matmul.c's, whole groups of 64 columns a half)."""
        return self._swiglu is not None

    @property
    def swiglu_ok(self) -> bool:
        return self.swiglu_fused or (self.n % 2 == 0 and kernels.f32_swiglu() is not None)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this stacked product (gate outputs first) for float32 rows x [M, K], as [M, N / 2]
        (only where `swiglu_ok`): in the product's epilogue, the [M, N] product never written, where this build
        has one (f32_matmul.c's), else the product and then f32_layers.c's SwiGLU over it."""
        if self._swiglu is None:
            out = ops.swiglu(self(x))
            assert out is not None  # (swiglu_ok)
            return out
        out = torch.empty(*x.shape[:-1], self.n // 2, dtype=torch.float32)
        rows = self._rows(x)
        if out.numel() and self._swiglu(self.packed.data_ptr(), self.mode, self.n, self.k, rows.data_ptr(),
                                        rows.stride(0), rows.shape[0],
                                        None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                                        self.n // 2):
            raise MemoryError("the float32 SwiGLU kernel could not allocate its workspace")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its maximum product (bias ignored), as int64 [M]."""
        rows = x.float().contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int32)
        if x.shape[0]:
            self._run(rows, None, tokens)
        return tokens.long()


class Bf16Matmul:
    """csrc/bf16_matmul.c for one bf16 weight [N, K] (K even) and optional bias [N]: x @ W^T + bias in bf16
    for bf16 rows x [M, K], or each row's argmax over N without writing the product. The weight is packed
    once for the kernel: tiles of 16 output rows, each [K/2][16][2] (a copy: the caller decides whether
    to keep the original)."""

    TILE = 16

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        self.packed = tiles(weight.detach(), 2)
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded(n) - n))
        self.n, self.k = n, k
        self.fn = fn

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Bf16Matmul | None":
        """The kernel for this weight, or None where it does not apply (not a bf16 CPU weight, odd K) or
        cannot run (see `load`)."""
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
            return None
        fn = kernels.bf16_matmul()
        return None if fn is None else cls(fn, weight, bias)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows `index` [T] (bf16) [T, K]: a tied embedding's lookups."""
        return tile_rows(self.packed, index)

    def _run(self, x: torch.Tensor, out: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
        x = x.to(torch.bfloat16).contiguous()
        bias = None if self.bias is None or out is None else self.bias.data_ptr()
        if self.fn(self.packed.data_ptr(), self.n, self.k, x.data_ptr(), x.shape[0], bias,
                   None if out is None else out.data_ptr(), self.n, None if tokens is None else tokens.data_ptr()):
            raise MemoryError("the bf16 matmul kernel could not allocate its workspace")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.n, dtype=torch.bfloat16)
        if out.numel():
            self._run(x.reshape(-1, self.k), out, None)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its maximum product (bias ignored), as int64 [M]."""
        tokens = torch.empty(x.shape[0], dtype=torch.int32)
        if x.shape[0]:
            self._run(x, None, tokens)
        return tokens.long()


class _Screen:
    """What the LM head's screens share: a count of the rows screened and redone, and whether screening still pays
    (`active`: after `_TRIAL` rows with more than `_REDO_MAX` of them redone, it stops)."""

    _TRIAL, _REDO_MAX = 1024, 1 / 8
    kind = ""  # what the log and the head's path call it

    def __init__(self) -> None:
        self.rows = self.redone = 0

    @property
    def active(self) -> bool:
        return self.rows < self._TRIAL or self.redone <= self._REDO_MAX * self.rows

    def _counted(self, rows: int, redone: int) -> None:
        if redone < 0:
            raise MemoryError(f"the {self.kind} argmax kernel could not allocate its workspace")
        self.rows += rows
        self.redone += redone
        if not self.active:
            log.info("LM head: greedy rows no longer screened in %s (%d of %d rows had to be redone)", self.kind,
                     self.redone, self.rows)


class Bf16Screen(_Screen):
    """csrc/f32_int8_argmax.c's bf16 screen for a float32 head whose weight is bf16 (F32Matmul's packed tiles,
    not AMX's), on AVX512-BF16: each row rounded to bf16 and screened with VDPBF16PS on the head's own packed
    weight (no copy), the columns within ||x - bf16(x)|| ||w_v|| of the best settled on the kernel's exact logits:
    the kernel's tokens. Rounding x to bf16 moves a logit by about 2^-9 of ||x|| ||w_v|| where an int8 row moves
    it by max |x| / 254 a value: on a trained model's rows (a few large values) the int8 screen keeps thousands
    of columns and stops, this one one or a few (bench/JOURNAL.md)."""

    kind = "bf16"
    _CHUNK = 1 << 21  # weight rows' values normed at a time (float64 copies of 16 MB)

    def __init__(self, fn, kernel: F32Matmul, weight: torch.Tensor) -> None:
        super().__init__()
        n, k = weight.shape
        self.err, self.norm = torch.zeros(2, padded(n), dtype=torch.float32)  # (e_v: the weight is exact)
        step = max(1, self._CHUNK // k)
        for i in range(0, n, step):  # (rounded up: their float32 copies still bound)
            rows = weight[i:i + step].detach().double()
            self.norm[i:i + len(rows)] = (rows.norm(dim=1) * (1 + 2**-10) + 1e-30).float()
        self.largest = self.norm.max().item()
        self.kernel, self.n, self.k, self.fn = kernel, n, k, fn

    @classmethod
    def build(cls, kernel: F32Matmul | None, weight: torch.Tensor) -> "Bf16Screen | None":
        """The screen for a float32 kernel's bf16 weight, or None where it does not apply (a float32 weight, AMX's
        head: settled there by its own screen) or cannot run (no AVX512-BF16 build)."""
        if kernel is None or kernel.mode != 1 or (fn := kernels.f32_bf16_argmax()) is None:
            return None
        return cls(fn, kernel, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its maximum logit, as int64 [M]."""
        x = x.to(torch.float32).contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int32)
        if x.shape[0]:
            self._counted(x.shape[0], self.fn(self.kernel.packed.data_ptr(), self.err.data_ptr(),
                                              self.norm.data_ptr(), self.n, self.k, self.largest, x.data_ptr(),
                                              x.shape[0], tokens.data_ptr()))
        return tokens.long()


class Int8Argmax(_Screen):
    """csrc/int8_argmax.c for a bf16 kernel's weight (csrc/f32_int8_argmax.c for a float32 kernel's): each
    row's argmax screened on an int8 copy of the weight and settled on the exact logits of the few columns
    the screen keeps, computed as the kernel computes them: the same tokens as the kernel's `argmax`, at
    about twice its speed where that is compute-bound (batch 16-64).

    A row the screen cannot narrow enough is computed again in full by the bf16 kernel. Where that is
    common (a model whose top logits sit closer together than the int8 error bound), screening costs more
    than it saves, and it stops (`active`)."""

    kind = "int8"
    _CHUNK = 1 << 21  # weight elements quantized at a time (bounds the float64 copies: 16 MB each)

    def __init__(self, fn, kernel: Bf16Matmul | F32Matmul, weight: torch.Tensor) -> None:
        super().__init__()
        n, k = weight.shape
        q = torch.zeros(n, k, dtype=torch.int8)
        # per column (zero past n): s_v, e_v = ||w_v - s_v q_v||, n_v = ||s_v q_v||, and ||w_v||
        self.scale, self.err, self.norm, norm_w = torch.zeros(4, padded(n), dtype=torch.float32)
        step = max(1, self._CHUNK // k)
        for i in range(0, n, step):
            w = weight[i:i + step].detach().double()
            amax = w.abs().amax(dim=1)
            s = torch.where(amax > 0, amax / 127, 1.0).float().double()  # (the float32 s_v the kernel uses)
            qi = torch.round(w / s[:, None]).clamp_(-127, 127)
            rows = slice(i, i + len(w))
            q[rows] = qi.to(torch.int8)
            self.scale[rows] = s.float()
            # (bounds rounded up: their float32 copies and the kernel's float sums of them still bound)
            for out, x in ((self.err, w - qi * s[:, None]), (self.norm, qi * s[:, None]), (norm_w, w)):
                out[rows] = (x.norm(dim=1) * (1 + 2**-10) + 1e-30).float()
        self.start = F.pad(-128 * q.sum(dim=1, dtype=torch.int32), (0, padded(n) - n))
        self.packed = tiles(q, 4)
        self.largest = [x.max().item() for x in (self.err, norm_w, self.norm)]
        self.kernel, self.n, self.k, self.fn = kernel, n, k, fn
        self._weights = [t.data_ptr() for t in (self.packed, self.start, self.scale, self.err, self.norm,
                                                kernel.packed)]
        self.f32 = isinstance(kernel, F32Matmul)
        if isinstance(kernel, F32Matmul):
            self._weights.append(kernel.mode)

    @classmethod
    def build(cls, kernel: Bf16Matmul | F32Matmul | None, weight: torch.Tensor) -> "Int8Argmax | None":
        """The screen for a kernel's weight, or None where it does not apply (no kernel, K not a multiple of
        4) or cannot run (see `load`: AVX512-VNNI, and AVX512-BF16 for the bf16 kernel's; the float32 kernel's
        also on AVX2, `kernels.f32_int8_library`)."""
        if kernel is None or kernel.k % 4:
            return None
        if isinstance(kernel, F32Matmul):  # (an AMX head's rows settled the AMX way: its own logits)
            fn = kernels.f32_int8_argmax_amx() if kernel.mode == F32Matmul.AMX else kernels.f32_int8_argmax()
        else:
            fn = kernels.int8_argmax()
        return None if fn is None else cls(fn, kernel, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its maximum logit, as int64 [M]."""
        x = x.to(torch.float32 if self.f32 else torch.bfloat16).contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int32)
        if x.shape[0]:
            self._counted(x.shape[0], self.fn(*self._weights, self.n, self.k, *self.largest, x.data_ptr(),
                                              x.shape[0], tokens.data_ptr()))
        return tokens.long()
