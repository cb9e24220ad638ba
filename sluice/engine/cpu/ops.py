"""The CPU kernels for attention and norms, bf16 (AVX512-BF16) or float32 (AVX-512F, else AVX2 and FMA: the
f32_layers.c build `kernels.f32_step` picks, and prompts' causal attention `kernels.causal_library`'s) by the
tensors' dtype: each returns None / False, with nothing written, where it does not apply or cannot run (the
caller's torch path then does the work). The float32 kernels read and write a KV cache of float32, bf16, fp16
int8 or fp8 (`kv_kind`)."""
from __future__ import annotations

import torch

from sluice.engine.attention import cache_row
from sluice.engine.cpu import kernels

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# the KV cache dtypes the float32 kernels take (csrc/f32_vec.h's KV_* kinds)
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
             torch.int8: 5}


def attention_shape_ok(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the decode attention kernels take these heads (head dim a multiple of 16 up to 256, at most
    16 query heads per kv head)."""
    return not (dim % 16 or dim > 256 or heads % kv_heads or heads // kv_heads > 16)


def kv_kind(k_cache: torch.Tensor, v_cache: torch.Tensor, dim: int) -> int | None:
    """The float32 kernels' kind of a CPU cache pair (csrc/f32_vec.h's KV_*) for heads of `dim` values, or None
    where they do not take it."""
    kind = _KV_KINDS.get(k_cache.dtype)
    if (kind is None or v_cache.dtype != k_cache.dtype or {k_cache.device.type, v_cache.device.type} != {"cpu"}
            or k_cache.shape[-1] != cache_row(k_cache.dtype, dim) or v_cache.shape != k_cache.shape):
        return None
    return kind


def _one_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """Their dtype when they are CPU tensors of one dtype a kernel takes, else None."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or any(t.device.type != "cpu" for t in tensors):
        return None
    dtype = dtypes.pop()
    return dtype if dtype in _KERNEL_DTYPES else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                     out: torch.Tensor) -> bool:
    """csrc/decode_attention.c (bf16) or f32_layers.c (float32; the cache float32, 16- or 8-bit): attention of one
    query row per sequence over its keys in the paged cache, written into out's rows (see the C files for the
    shapes)."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    dtype, kind = _one_dtype(q, out), kv_kind(k_cache, v_cache, dim)
    if (dtype is None or kind is None or not attention_shape_ok(heads, kv_heads, dim) or q.stride(2) != 1
            or q.stride(1) != dim or not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous())):
        return False
    if dtype == torch.bfloat16:
        fn = kernels.decode_attention_bf16() if k_cache.dtype == torch.bfloat16 else None
        extra: tuple[int, ...] = ()
    else:
        fn = None if (lib := kernels.f32_step()) is None else lib.sluice_f32_decode_attention
        extra = (kind,)
    if fn is None:
        return False
    rows, slots = rows.contiguous(), slots.contiguous()
    mask = mask.reshape(slots.shape).contiguous().view(torch.uint8)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
                slots.data_ptr(), mask.data_ptr(), None if sinks is None else sinks.data_ptr(), slots.shape[0],
                heads, kv_heads, dim, slots.shape[1], scale, out.data_ptr(), *extra)
    if status:
        raise MemoryError("the decode attention kernel could not allocate its workspace")
    return True


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     starts: torch.Tensor | None = None) -> torch.Tensor | None:
    """csrc/causal_attention.c: prompts' (and prompt chunks') attention, float32, for q [B, Lq, H, D] and k, v
    [B, Lk, Hkv, D] with key i at position i: sequence b's query i is at position starts[b] + i (starts None:
    0) and attends keys 0..that. The output [B, Lq, H, D]; None where it does not apply (not float32, a
    shape it does not take, no kernel here)."""
    b, n, heads, dim = q.shape
    out = torch.empty_like(q)
    ok = _causal(q.contiguous(), None, k.contiguous(), v.contiguous(), None, starts, b, n, k.shape[1], scale, out,
                 None, -1)
    return out if ok else None


def paged_causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_index: torch.Tensor,
                           kv_slots: torch.Tensor, out_index: torch.Tensor, scale: float,
                           starts: torch.Tensor | None, out: torch.Tensor) -> bool:
    """`causal_attention` reading where things lie: sequence b's query i is row q_index[b, i] of a step's q
    [T, H, D], its key i the cache slot kv_slots[b, i] of k_cache and v_cache [slots, Hkv, D], its output
    row out_index[b, i] of out [T + 1, H, D] (the last row, the pads', is not written). False, nothing
    written, where it does not apply."""
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        return False
    b, n = q_index.shape
    return _causal(q, _int64(q_index), k_cache, v_cache, _int64(kv_slots), starts, b, n, kv_slots.shape[1], scale,
                   out, _int64(out_index), out.shape[0] - 1)


def _int64(index: torch.Tensor) -> torch.Tensor:
    return index.to(torch.int64).contiguous()


def _causal(q, q_rows, k, v, kv_rows, starts, batch: int, q_len: int, k_len: int, scale: float, out, out_rows,
            skip_row: int) -> bool:
    heads, dim = q.shape[-2:]
    if (_one_dtype(q, out) != torch.float32 or (kind := kv_kind(k, v, dim)) is None
            or not attention_shape_ok(heads, k.shape[-2], dim) or not k_len
            or (fn := kernels.causal_attention_f32()) is None):
        return False
    starts = None if starts is None else _int64(starts)
    status = fn(q.data_ptr(), _ptr(q_rows), k.data_ptr(), v.data_ptr(), _ptr(kv_rows), _ptr(starts), batch, q_len,
                k_len, heads, k.shape[-2], dim, scale, out.data_ptr(), _ptr(out_rows), skip_row, kind)
    if status == -1:
        raise MemoryError("the causal attention kernel could not allocate its workspace")
    return not status


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rope_store(qk: torch.Tensor, v: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor | None:
    """csrc/rope_store.c (bf16) or f32_layers.c (float32; the cache float32, 16- or 8-bit): rotary (tables cos/sin
    [P, D/2]) on the queries and keys qk [T, H + Hkv, D], the rotated keys and the values v [T, Hkv, D] written
    into the caches at `slots` [T]; returns the rotated queries [T, H, D]."""
    t, _, dim = qk.shape
    dtype, kind = _one_dtype(qk, v), kv_kind(k_cache, v_cache, dim)
    if (dtype is None or kind is None or (dtype == torch.bfloat16 and k_cache.dtype != dtype)
            or (dtype == torch.float32 and kind and (dim % 16 or dim > 256))  # (narrower rows: whole vectors)
            or {cos.dtype, sin.dtype} != {torch.float32} or dim % 2 or cos.shape[1] != dim // 2
            or qk.stride(2) != 1 or qk.stride(1) != dim or v.stride(2) != 1 or v.stride(1) != dim
            or not all(x.is_contiguous() for x in (cos, sin, k_cache, v_cache))):
        return None
    positions, slots = positions.contiguous(), slots.contiguous()
    q = qk.new_empty(t, heads, dim)
    if dtype == torch.bfloat16:
        fn = kernels.rope_store_bf16()
        if fn is None:
            return None
        status = t and fn(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), t, heads, v.shape[1], dim,
                          positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], slots.data_ptr(),
                          k_cache.shape[0], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    else:
        if (lib := kernels.f32_step()) is None:
            return None
        # (the kernel writes q/k norms in place when asked; here it is given none and leaves qk alone)
        status = t and lib.sluice_f32_rope_store(
            qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), t, heads, v.shape[1], dim, None, None, 0.0,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], slots.data_ptr(), k_cache.shape[0],
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kind)
    if status:
        raise IndexError("a position beyond the rotary table or a slot beyond the KV cache")
    return q


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """csrc/rms_norm.c (bf16) or f32_layers.c (float32) over the last dimension of rows x [T, D]."""
    dtype = _one_dtype(x, weight)
    if dtype is None or x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1) or not weight.is_contiguous():
        return None
    if dtype == torch.bfloat16:
        fn = kernels.rms_norm_bf16()
    else:
        fn = None if (lib := kernels.f32_step()) is None else lib.sluice_f32_rms_norm
    if fn is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        fn(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(), out.stride(0))
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a float32 gate-and-up product [M, 2 I] (gate columns first) as [M, I], on csrc/f32_layers.c's
    SwiGLU (the one-call step's, the team's threads over the rows), or None where it does not run."""
    fn = kernels.f32_swiglu()
    if fn is None or gate_up.dtype != torch.float32 or gate_up.shape[-1] % 2:
        return None
    rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    out = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=torch.float32)
    if out.numel():
        fn(rows.data_ptr(), rows.shape[0], rows.shape[1] // 2, out.data_ptr())
    return out
