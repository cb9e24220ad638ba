"""Sluice's C kernels for the CPU: compiled on first use with the machine's C compiler, cached under the
cache directory (keyed by the source and the flags) and loaded with ctypes.

A kernel is optional: without a compiler, on a CPU without the instructions it needs, with no writable
cache directory, when the build fails, or with SLUICE_CPU_KERNELS=0, `load` returns None and the caller
keeps its torch path. The kernels use OpenMP; torch is imported first, so they share the libgomp (and the
threads) torch runs on.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # (loaded before any kernel: its libgomp is the one the kernels link to)
import torch.nn.functional as F

from sluice import envs

log = logging.getLogger("sluice.engine")

_SOURCES = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
# Instruction sets (as /proc/cpuinfo names them) -> the compiler flags that enable them.
_ISA = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_bf16": "-mavx512bf16",
        "avx512_vnni": "-mavx512vnni"}
_AVX512 = ("avx512f", "avx512bw")
_AVX512_BF16 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_AVX512_VNNI = (*_AVX512_BF16, "avx512_vnni")
_BUILD_TIMEOUT_S = 120


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def load(name: str, isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel library csrc/<name>.c (with the headers beside it) built for the instruction sets `isa`,
    or None, with one warning saying why, where it cannot be built or loaded: the caller keeps its torch
    path. Never raises (a kernel is worth a build, not a crashed engine)."""
    if not envs.cpu_kernels_enabled():
        return None
    missing = [f for f in isa if f not in cpu_flags()]
    if missing:
        log.info("CPU kernel %s not used: this CPU lacks %s", name, ", ".join(missing))
        return None
    if not _torch_runs_libgomp():
        log.info("CPU kernel %s not used: torch's OpenMP runtime is not libgomp", name)
        return None
    try:
        compiler = _compiler()
        source = _SOURCES / f"{name}.c"
        flags = [*_FLAGS, *(_ISA[f] for f in isa)]
        path = envs.cache_dir() / "kernels" / f"{name}-{_key(source, flags)}.so"
        if not path.exists():
            _build(compiler, flags, source, path)
        return ctypes.CDLL(str(path))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("CPU kernel %s not used (torch's path instead): %s", name, _why(e))
        return None


def _compiler() -> list[str]:
    """CC as a command line (`ccache gcc`), else cc or gcc; FileNotFoundError where there is none."""
    command = envs.c_compiler()
    if command is None:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            raise FileNotFoundError("no C compiler (install cc or gcc, or set CC)")
        return [found]
    if shutil.which(command[0]) is None:
        raise FileNotFoundError(f"the C compiler {command[0]!r} (CC) is not found")
    return command


def _key(source: Path, flags: list[str]) -> str:
    """What a build depends on: the flags and every source (a source may include another's)."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for part in [source, *sorted(_SOURCES.iterdir())]:
        digest.update(part.read_bytes())
    return digest.hexdigest()[:16]


def _build(compiler: list[str], flags: list[str], source: Path, path: Path) -> None:
    """Compiles source into path. Builds of other sources or flags are left alone: the cache may be shared
    by installs of other versions, each loading its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-I", str(_SOURCES), "-o", tmp, str(source)], check=True,
                       capture_output=True, timeout=_BUILD_TIMEOUT_S)
        os.replace(tmp, path)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _why(e: Exception) -> str:
    """A failed build or load in one line."""
    if isinstance(e, subprocess.CalledProcessError):
        lines = [line for line in (e.stderr or b"").decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line] or lines[-1:]
        return f"the build failed (exit {e.returncode})" + (f": {errors[0].strip()}" if errors else "")
    if isinstance(e, subprocess.TimeoutExpired):
        return f"the build took longer than {e.timeout:.0f}s"
    if isinstance(e, ValueError):
        return f"CC does not parse as a command line ({e})"
    return str(e)


def _torch_runs_libgomp() -> bool:
    """Whether the libgomp the kernels link to is the OpenMP runtime torch has loaded (not a second pool
    of threads beside torch's)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _padded(n: int) -> int:
    """n rounded up to whole tiles of 16 output rows."""
    return -(-n // Bf16Matmul.TILE) * Bf16Matmul.TILE


def _tiles(w: torch.Tensor, group: int) -> torch.Tensor:
    """A weight [N, K] packed as the kernels read it: tiles of 16 output rows (zero rows past N), each
    [K / group][16][group] (for every `group` consecutive columns, the 16 rows' values side by side)."""
    n, k = w.shape
    tile = Bf16Matmul.TILE
    w = F.pad(w, (0, 0, 0, _padded(n) - n))
    return w.view(-1, tile, k // group, group).permute(0, 2, 1, 3).contiguous()


class Bf16Matmul:
    """csrc/bf16_matmul.c for one bf16 weight [N, K] (K even) and optional bias [N]: x @ W^T + bias in bf16
    for bf16 rows x [M, K], or each row's argmax over N without writing the product. The weight is packed
    once for the kernel: tiles of 16 output rows, each [K/2][16][2] (a copy: the caller decides whether
    to keep the original)."""

    TILE = 16

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        self.packed = _tiles(weight.detach(), 2)
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, _padded(n) - n))
        self.n, self.k = n, k
        self.fn = fn

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Bf16Matmul | None":
        """The kernel for this weight, or None where it does not apply (not a bf16 CPU weight, odd K) or
        cannot run (see `load`)."""
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
            return None
        fn = _bf16_matmul()
        return None if fn is None else cls(fn, weight, bias)

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


class Int8Argmax:
    """csrc/int8_argmax.c for a bf16 kernel's weight: each row's argmax screened on an int8 copy of the
    weight and settled on the exact bf16 logits of the few columns the screen keeps: the same tokens as
    `Bf16Matmul.argmax`, at about twice its speed where that is compute-bound (batch 16-64).

    A row the screen cannot narrow enough is computed again in full by the bf16 kernel. Where that is
    common (a model whose top logits sit closer together than the int8 error bound), screening costs more
    than it saves: after `_TRIAL` rows with more than `_REDO_MAX` of them redone, it stops (`active`)."""

    _TRIAL, _REDO_MAX = 1024, 1 / 8
    _CHUNK = 1 << 21  # weight elements quantized at a time (bounds the float64 copies: 16 MB each)

    def __init__(self, fn, kernel: Bf16Matmul, weight: torch.Tensor) -> None:
        n, k = weight.shape
        q = torch.zeros(n, k, dtype=torch.int8)
        # per column (zero past n): s_v, e_v = ||w_v - s_v q_v||, n_v = ||s_v q_v||, and ||w_v||
        self.scale, self.err, self.norm, norm_w = torch.zeros(4, _padded(n), dtype=torch.float32)
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
        self.start = F.pad(-128 * q.sum(dim=1, dtype=torch.int32), (0, _padded(n) - n))
        self.packed = _tiles(q, 4)
        self.largest = [x.max().item() for x in (self.err, norm_w, self.norm)]
        self.kernel, self.n, self.k, self.fn = kernel, n, k, fn
        self._weights = [t.data_ptr() for t in (self.packed, self.start, self.scale, self.err, self.norm,
                                                kernel.packed)]
        self.rows = self.redone = 0

    @classmethod
    def build(cls, kernel: Bf16Matmul | None, weight: torch.Tensor) -> "Int8Argmax | None":
        """The screen for a bf16 kernel's weight, or None where it does not apply (no kernel, K not a
        multiple of 4) or cannot run (see `load`)."""
        if kernel is None or kernel.k % 4:
            return None
        fn = _int8_argmax()
        return None if fn is None else cls(fn, kernel, weight)

    @property
    def active(self) -> bool:
        return self.rows < self._TRIAL or self.redone <= self._REDO_MAX * self.rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its maximum bf16 logit, as int64 [M]."""
        x = x.to(torch.bfloat16).contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int32)
        if x.shape[0]:
            redone = self.fn(*self._weights, self.n, self.k, *self.largest, x.data_ptr(), x.shape[0],
                             tokens.data_ptr())
            if redone < 0:
                raise MemoryError("the int8 argmax kernel could not allocate its workspace")
            self.rows += x.shape[0]
            self.redone += redone
            if not self.active:
                log.info("LM head: greedy rows no longer screened in int8 (%d of %d rows had to be redone)",
                         self.redone, self.rows)
        return tokens.long()


def _function(name: str, isa: tuple[str, ...], symbol: str, argtypes: list):
    lib = load(name, isa)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


_P, _I = ctypes.c_void_p, ctypes.c_int


@functools.cache
def _bf16_matmul():
    return _function("bf16_matmul", _AVX512_BF16, "sluice_bf16_matmul", [_P, _I, _I, _P, _I, _P, _P, _I, _P])


@functools.cache
def _int8_argmax():
    _F = ctypes.c_float
    return _function("int8_argmax", _AVX512_VNNI, "sluice_int8_argmax",
                     [_P, _P, _P, _P, _P, _P, _I, _I, _F, _F, _F, _P, _I, _P])


@functools.cache
def exp_blocks():
    """csrc/exp_blocks.c's function (None where it cannot run): see engine.sampler.exp_blocks."""
    return _function("exp_blocks", _AVX512, "sluice_exp_blocks", [_P, _I, _I, _I, _P, _P, _P, _I, _P])


@functools.cache
def exp_block():
    """csrc/exp_blocks.c's probs of one block a row (None where it cannot run): see engine.sampler."""
    return _function("exp_blocks", _AVX512, "sluice_exp_block", [_P, _I, _I, _I, _P, _P, _P, _I, _P])


@functools.cache
def _decode_attention():
    return _function("decode_attention", _AVX512_BF16, "sluice_decode_attention",
                     [_P, ctypes.c_long, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P])


def _attention_shape_ok(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether csrc/decode_attention.c takes these heads (head dim a multiple of 16 up to 256, at most 16
    query heads per kv head)."""
    return not (dim % 16 or dim > 256 or heads % kv_heads or heads // kv_heads > 16)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                     out: torch.Tensor) -> bool:
    """csrc/decode_attention.c: attention of one query row per sequence over its keys in the paged cache,
    written into out's rows (see the C file for the shapes). False, with nothing written, where the
    kernel does not apply or cannot run: the caller's torch path then does the work."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if (q.device.type != "cpu" or {q.dtype, k_cache.dtype, v_cache.dtype, out.dtype} != {torch.bfloat16}
            or not _attention_shape_ok(heads, kv_heads, dim) or q.stride(2) != 1 or q.stride(1) != dim
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous())):
        return False
    fn = _decode_attention()
    if fn is None:
        return False
    rows, slots = rows.contiguous(), slots.contiguous()
    mask = mask.reshape(slots.shape).contiguous().view(torch.uint8)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
                slots.data_ptr(), mask.data_ptr(), None if sinks is None else sinks.data_ptr(), slots.shape[0],
                heads, kv_heads, dim, slots.shape[1], scale, out.data_ptr())
    if status:
        raise MemoryError("the decode attention kernel could not allocate its workspace")
    return True


@functools.cache
def _rope_store():
    return _function("rope_store", _AVX512_BF16, "sluice_rope_store",
                     [_P, ctypes.c_long, _P, ctypes.c_long, _I, _I, _I, _I, _P, _P, _P, _I, _P, ctypes.c_long,
                      _P, _P, _P])


def rope_store(qk: torch.Tensor, v: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor | None:
    """csrc/rope_store.c: rotary (tables cos/sin [P, D/2]) on the queries and keys qk [T, H + Hkv, D], the
    rotated keys and the values v [T, Hkv, D] written into the caches at `slots` [T]; returns the rotated
    queries [T, H, D]. None, with nothing written, where the kernel does not apply or cannot run."""
    t, _, dim = qk.shape
    if (qk.device.type != "cpu" or {qk.dtype, v.dtype, k_cache.dtype, v_cache.dtype} != {torch.bfloat16}
            or {cos.dtype, sin.dtype} != {torch.float32} or dim % 2 or cos.shape[1] != dim // 2
            or qk.stride(2) != 1 or qk.stride(1) != dim or v.stride(2) != 1 or v.stride(1) != dim
            or not all(x.is_contiguous() for x in (cos, sin, k_cache, v_cache))):
        return None
    fn = _rope_store()
    if fn is None:
        return None
    positions, slots = positions.contiguous(), slots.contiguous()
    q = qk.new_empty(t, heads, dim)
    if t and fn(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), t, heads, v.shape[1], dim,
                positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], slots.data_ptr(),
                k_cache.shape[0], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()):
        raise IndexError("a position beyond the rotary table or a slot beyond the KV cache")
    return q


@functools.cache
def _rms_norm():
    return _function("rms_norm", _AVX512_BF16, "sluice_rms_norm",
                     [_P, ctypes.c_long, _P, _I, _I, ctypes.c_float, _P, ctypes.c_long])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """csrc/rms_norm.c over the last dimension of bf16 rows x, or None where it does not apply."""
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1) or not weight.is_contiguous()):
        return None
    fn = _rms_norm()
    if fn is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        fn(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(), out.stride(0))
    return out


class _LinearSpec(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("n", _I), ("k", _I)]


class _LayerSpec(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("qkv", _LinearSpec), ("o", _LinearSpec), ("gate_up", _LinearSpec), ("down", _LinearSpec),
                ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("cos", _P), ("sin", _P), ("num_positions", _I),
                ("k_cache", _P), ("v_cache", _P), ("num_slots", ctypes.c_long), ("sinks", _P)]


class _StepSpec(ctypes.Structure):
    _fields_ = [("tokens", _I), ("hidden", _I), ("keys", _I), ("positions", _P), ("slot_mapping", _P),
                ("rows", _P), ("kv_slots", _P), ("mask", _P)]


@functools.cache
def _decoder_layers():
    return _function("decoder_layers", _AVX512_BF16, "sluice_decoder_layers",
                     [ctypes.POINTER(_LayerSpec), _I, ctypes.POINTER(_StepSpec), _P])


@dataclass
class DecodeLayer:
    """What csrc/decoder_layers.c needs of one pre-norm Llama-family layer (bf16 tensors, except the rotary
    tables and sinks in float32)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor
    eps: float
    qkv: Bf16Matmul  # queries, keys, values stacked
    o: Bf16Matmul
    gate_up: Bf16Matmul  # gate rows, then up rows (SwiGLU)
    down: Bf16Matmul
    heads: tuple[int, int, int]  # query heads, kv heads, head dim
    scale: float
    cos: torch.Tensor  # [positions, head dim / 2]
    sin: torch.Tensor
    k_cache: torch.Tensor  # [slots, kv heads, head dim]
    v_cache: torch.Tensor
    sinks: torch.Tensor | None  # [heads]


class DecoderStack:
    """csrc/decoder_layers.c over a model's layers: a step through every layer in one call, each row
    attending as one query (a decode, or a prefill chunk's row at its position; see the C file), where ~20
    torch ops and kernel calls a layer cost ~0.2 ms at batch 1."""

    def __init__(self, fn, layers: list[DecodeLayer], hidden: int) -> None:
        self.fn, self.hidden, self.count = fn, hidden, len(layers)
        self._keep = [layer.sinks.detach().float().contiguous() if layer.sinks is not None else None
                      for layer in layers]
        self.specs = (_LayerSpec * len(layers))(*(self._spec(layer, sinks) for layer, sinks in zip(layers, self._keep)))
        self._layers = layers  # (what the specs point into)

    @staticmethod
    def _spec(layer: DecodeLayer, sinks: torch.Tensor | None) -> _LayerSpec:
        def linear(m: Bf16Matmul) -> _LinearSpec:
            return _LinearSpec(m.packed.data_ptr(), None if m.bias is None else m.bias.data_ptr(), m.n, m.k)

        heads, kv_heads, dim = layer.heads
        return _LayerSpec(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), layer.eps, layer.scale,
                          linear(layer.qkv), linear(layer.o), linear(layer.gate_up), linear(layer.down), heads,
                          kv_heads, dim, layer.cos.data_ptr(), layer.sin.data_ptr(), layer.cos.shape[0],
                          layer.k_cache.data_ptr(), layer.v_cache.data_ptr(), layer.k_cache.shape[0],
                          None if sinks is None else sinks.data_ptr())

    @classmethod
    def build(cls, layers: list[DecodeLayer]) -> "DecoderStack | None":
        """The stack, or None where a layer's shapes or dtypes are not the kernel's or it cannot run."""
        if not layers:
            return None
        hidden = layers[0].qkv.k
        for layer in layers:
            heads, kv_heads, dim = layer.heads
            tensors = (layer.input_norm, layer.post_norm, layer.k_cache, layer.v_cache)
            if (any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors)
                    or {layer.cos.dtype, layer.sin.dtype} != {torch.float32}
                    or not (layer.cos.is_contiguous() and layer.sin.is_contiguous())
                    or layer.cos.shape[1] != dim // 2 or not _attention_shape_ok(heads, kv_heads, dim)
                    or layer.k_cache.shape[1:] != (kv_heads, dim)
                    or layer.input_norm.shape != (hidden,) or layer.post_norm.shape != (hidden,)
                    or (layer.qkv.k, layer.qkv.n) != (hidden, (heads + 2 * kv_heads) * dim)
                    or (layer.o.k, layer.o.n) != (heads * dim, hidden) or layer.gate_up.k != hidden
                    or layer.gate_up.n % 2 or (layer.down.k, layer.down.n) != (layer.gate_up.n // 2, hidden)):
                return None
        fn = _decoder_layers()
        return None if fn is None else cls(fn, layers, hidden)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor,
                 kv_slots: torch.Tensor, mask: torch.Tensor) -> bool:
        """Runs the layers over a step, in place on x [T, hidden] (bf16, contiguous): positions and
        slot_mapping [T], and each attention row's row of x, its keys' slots and mask (rows [T], kv_slots and
        mask [T, K]) as `decode_attention` takes them. False, with nothing done, where x is not the kernel's."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != self.hidden or not x.is_contiguous():
            return False
        tokens, keys = kv_slots.shape
        positions, slot_mapping, rows, kv_slots = (t.contiguous() for t in (positions, slot_mapping, rows, kv_slots))
        mask = mask.reshape(tokens, keys).contiguous().view(torch.uint8)
        step = _StepSpec(tokens, self.hidden, keys, positions.data_ptr(), slot_mapping.data_ptr(), rows.data_ptr(),
                         kv_slots.data_ptr(), mask.data_ptr())
        status = self.fn(self.specs, self.count, step, x.data_ptr()) if tokens else 0
        if status == -3:
            raise IndexError("a position beyond the rotary table or a slot beyond the KV cache")
        if status == -1:
            raise MemoryError("the decoder layers kernel could not allocate its workspace")
        if status:
            raise RuntimeError(f"the decoder layers kernel refused the step ({status})")
        return True


def clear() -> None:
    """Forgets what was loaded (tests that change the environment)."""
    for cached in (load, _bf16_matmul, _int8_argmax, exp_blocks, exp_block, _decode_attention, _rope_store,
                   _rms_norm, _decoder_layers):
        cached.cache_clear()
