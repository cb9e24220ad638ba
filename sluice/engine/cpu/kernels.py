"""The C kernels' entry points (engine/csrc/, built and loaded by engine/cpu/build.py), each None where it
cannot run here, and the weight layouts they read."""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from sluice.engine.cpu.build import (_AMX, _AVX2, _AVX512, _AVX512_BF16, _AVX512_VL, _AVX512_VL_VNNI, _AVX512_VNNI,
                                     _forgetters, cpu_flags, load)

log = logging.getLogger("sluice.engine")

P, INT, L, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
TILE = 16  # output rows a packed tile holds


def _function(name: str, isa: tuple[str, ...], symbol: str, argtypes: list):
    lib = load(name, isa)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def padded(n: int) -> int:
    """n rounded up to whole tiles of 16 output rows."""
    return -(-n // TILE) * TILE


def tiles(w: torch.Tensor, group: int) -> torch.Tensor:
    """A weight [N, K] packed as the kernels read it: tiles of 16 output rows (zero rows past N), each
    [K / group][16][group] (for every `group` consecutive columns, the 16 rows' values side by side)."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, padded(n) - n))
    return w.view(-1, TILE, k // group, group).permute(0, 2, 1, 3).contiguous()


def tile_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [T] of a weight packed by `tiles` ([N/16][K/group][16][group]), as [T, K]."""
    whole = packed.shape[-1] * packed.element_size() == 4  # (a group's values gathered as one 4-byte unit: 2.5x)
    rows = (packed.view(torch.int32) if whole else packed)[index // TILE, :, index % TILE]
    return rows.reshape(index.numel(), packed.shape[1]).view(packed.dtype) if whole else \
        rows.reshape(index.numel(), packed.shape[1] * packed.shape[3])


def pair_tiles(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (K even) as csrc/f32_matmul.c reads it: tiles of 16 output rows, each
    [K / 2][2][16] (for every pair of columns, the 16 rows' values of the first, then of the second)."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, padded(n) - n))
    return w.view(-1, TILE, k // 2, 2).permute(0, 2, 3, 1).contiguous()


def pair_tile_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [T] of a weight packed by `pair_tiles` ([N/16][K/2][2][16]), as [T, K]."""
    return packed[index // TILE, :, :, index % TILE].reshape(index.numel(), 2 * packed.shape[1])


_LINEAR_F32: list[Any] = [P, INT, INT, INT, P, L, INT, P, P, L, P]
_CAUSAL_F32 = [P, P, P, P, P, P, INT, INT, INT, INT, INT, INT, FLOAT, P, P, L, INT]


def _cached(fn):
    cached = functools.cache(fn)
    _forgetters.append(cached.cache_clear)
    return cached


@_cached
def bf16_matmul():
    return _function("bf16_matmul", _AVX512_BF16, "sluice_bf16_matmul", [P, INT, INT, P, INT, P, P, INT, P])


@_cached
def int8_argmax():
    return _function("int8_argmax", _AVX512_VNNI, "sluice_int8_argmax",
                     [P, P, P, P, P, P, INT, INT, FLOAT, FLOAT, FLOAT, P, INT, P])


_F32_INT8_ARGMAX = [P, P, P, P, P, P, INT, INT, INT, FLOAT, FLOAT, FLOAT, P, INT, P]


# the builds of csrc/f32_int8_argmax.c (int8_screen.h's two), the best first, and their names in the log
SCREEN_ISAS: dict[tuple[str, ...], str] = {_AVX512_VL_VNNI: "AVX512-VNNI", _AVX2: "AVX2 (VPMADDUBSW)"}


@_cached
def f32_int8_library(isa: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """csrc/f32_int8_argmax.c built for `isa` (None: the best of SCREEN_ISAS this CPU runs, logged), or None."""
    return _library("f32_int8_argmax", {"sluice_f32_int8_argmax": _F32_INT8_ARGMAX}, isa, SCREEN_ISAS)


def f32_int8_argmax():
    """The float32 head's int8 screen (csrc/f32_int8_argmax.c) of the best build this CPU runs, or None."""
    return None if (lib := f32_int8_library()) is None else lib.sluice_f32_int8_argmax


@_cached
def f32_bf16_argmax():
    """The float32 head's bf16 screen for a bf16 weight (csrc/f32_int8_argmax.c built for AVX512-BF16), or None."""
    return _function("f32_int8_argmax", _AVX512_VNNI, "sluice_f32_bf16_argmax", [P, P, P, INT, INT, FLOAT, P, INT, P])


@_cached
def f32_int8_argmax_amx():
    """The same screen built with AMX, which settles an AMX head's rows as its product computes them (None
    where f32_layers' linears do not run on AMX)."""
    if not f32_amx():
        return None
    return _function("f32_int8_argmax", (*_AMX, "avx512_vnni"), "sluice_f32_int8_argmax", _F32_INT8_ARGMAX)


# the builds of a float32 kernel written on csrc/f32_vec.h's vectors, the widest first, and their names in the log
F32_ISAS: dict[tuple[str, ...], str] = {_AVX512: "AVX-512F", _AVX2: "AVX2 and FMA"}


def _library(name: str, symbols: dict[str, list], isa: tuple[str, ...] | None,
             isas: dict[tuple[str, ...], str] | None = None) -> ctypes.CDLL | None:
    """csrc/<name>.c built for `isa` (None: the first of `isas`, by default F32_ISAS, this CPU runs, logged) with
    its symbols' signatures set, or None where it cannot run."""
    isas = F32_ISAS if isas is None else isas
    for each in isas if isa is None else [isa]:
        if (lib := load(name, each)) is not None:
            for symbol, argtypes in symbols.items():
                fn = getattr(lib, symbol)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
            if isa is None:
                log.info("CPU kernel %s: %s", name, isas[each])
            return lib
    return None


_EXP = [P, INT, INT, INT, P, P, P, INT, P]


@_cached
def exp_library(isa: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """csrc/exp_blocks.c (see sluice.engine.sampler.exp_blocks) built for `isa` (None: the widest this CPU
    runs), or None."""
    return _library("exp_blocks", {"sluice_exp_blocks": _EXP, "sluice_exp_block": _EXP}, isa)


def exp_blocks():
    """csrc/exp_blocks.c's function (None where it cannot run): see sluice.engine.sampler.exp_blocks."""
    return None if (lib := exp_library()) is None else lib.sluice_exp_blocks


def exp_block():
    """csrc/exp_blocks.c's probs of one block a row (None where it cannot run): see sluice.engine.sampler."""
    return None if (lib := exp_library()) is None else lib.sluice_exp_block


@_cached
def decode_attention_bf16():
    return _function("decode_attention", _AVX512_BF16, "sluice_decode_attention",
                     [P, L, P, P, P, P, P, P, INT, INT, INT, INT, INT, FLOAT, P])


@_cached
def rope_store_bf16():
    return _function("rope_store", _AVX512_BF16, "sluice_rope_store",
                     [P, L, P, L, INT, INT, INT, INT, P, P, P, INT, P, L, P, P, P])


@_cached
def rms_norm_bf16():
    return _function("rms_norm", _AVX512_BF16, "sluice_rms_norm", [P, L, P, INT, INT, FLOAT, P, L])


@_cached
def decoder_layers_bf16():
    from sluice.engine.cpu.stack import LayerSpec, StepSpec

    return _function("decoder_layers", _AVX512_BF16, "sluice_decoder_layers",
                     [ctypes.POINTER(LayerSpec), INT, ctypes.POINTER(StepSpec), P])


@_cached
def f32_layers():
    """csrc/f32_layers.c (the float32 stack and its pieces) as a library, or None: built with AMX where the CPU
    has it and the kernel lets this process use it (`f32_amx`), else for AVX-512F alone."""
    lib = f32_layers_amx() or load("f32_layers", _AVX512_VL)
    return None if lib is None else _f32_entries(lib, swiglu=True)


@_cached
def f32_layers_avx2():
    """The same source built for AVX2 and FMA (its linears csrc/f32_matmul_avx2.c's; no SwiGLU epilogue), or
    None."""
    lib = load("f32_layers", _AVX2)
    return None if lib is None else _f32_entries(lib, swiglu=False)


def f32_step():
    """The float32 step's library (sluice_f32_layers and the pieces the op-by-op path calls alone) of the best
    instruction set this CPU runs, or None: `f32_layers`, else `f32_layers_avx2`."""
    return f32_layers() or f32_layers_avx2()


def f32_swiglu():
    """csrc/f32_layers.c's SwiGLU over rows of a gate-and-up product (gate columns, then up) of the best instruction
    set this CPU runs, or None."""
    return None if (lib := f32_step()) is None else lib.sluice_f32_swiglu


# sluice_f32_decode_attention's arguments (csrc/f32_layers.c)
_DECODE_F32 = [P, L, P, P, P, P, P, P, INT, INT, INT, INT, INT, FLOAT, P, INT]


def _f32_entries(lib: ctypes.CDLL, swiglu: bool) -> ctypes.CDLL:
    from sluice.engine.cpu.stack import F32LayerSpec, StepSpec

    for symbol, argtypes in (
            ("sluice_f32_layers", [ctypes.POINTER(F32LayerSpec), INT, ctypes.POINTER(StepSpec), P]),
            ("sluice_f32_rms_norm", [P, L, P, INT, INT, FLOAT, P, L]),
            ("sluice_f32_rope_store", [P, L, P, L, INT, INT, INT, INT, P, P, FLOAT, P, P, P, INT, P, L, P, P, P, INT]),
            ("sluice_f32_decode_attention", _DECODE_F32),
            ("sluice_f32_matmul", _LINEAR_F32),
            ("sluice_f32_swiglu", [P, INT, INT, P]),
            *([("sluice_f32_matmul_swiglu", _LINEAR_F32[:-1])] if swiglu else [])):
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


@_cached
def f32_layers_amx():
    """f32_layers.c built for AMX with the tile state granted to this process, or None (and why, once)."""
    if not set(_AMX) <= cpu_flags():
        return None
    if (lib := load("f32_layers", _AMX)) is None:
        return None
    lib.sluice_f32_amx_init.restype, lib.sluice_f32_amx_init.argtypes = ctypes.c_int, []
    if lib.sluice_f32_amx_init() != 0:
        log.info("AMX not used: the kernel does not grant this process the tile state (arch_prctl)")
        return None
    return lib


def f32_amx() -> bool:
    """Whether f32_layers' linears can run bf16 weights on AMX (F32Matmul.build takes it where K is a multiple
    of 32)."""
    return f32_layers() is not None and f32_layers_amx() is not None


@_cached
def causal_library(isa: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """csrc/causal_attention.c built for `isa` (None: the widest this CPU runs), or None."""
    return _library("causal_attention", {"sluice_f32_causal_attention": _CAUSAL_F32}, isa)


def causal_attention_f32():
    """csrc/causal_attention.c's attention for prompts and their chunks (float32; AVX-512F, else AVX2 and FMA),
    or None where it cannot run."""
    return None if (lib := causal_library()) is None else lib.sluice_f32_causal_attention


@_cached
def f32_matmul_avx2():
    """csrc/f32_matmul_avx2.c (f32_layers.c's sluice_f32_matmul for CPUs with AVX2 and FMA) as a library, or
    None."""
    lib = load("f32_matmul_avx2", _AVX2)
    if lib is None:
        return None
    lib.sluice_f32_matmul.restype, lib.sluice_f32_matmul.argtypes = ctypes.c_int, _LINEAR_F32
    return lib
