"""A step through every decoder layer of a model in one kernel call: csrc/decoder_layers.c for bf16
(AVX512-BF16), csrc/f32_layers.c for float32 (AVX-512F, else built for AVX2 and FMA; its linears on
csrc/f32_matmul.c, or on csrc/quant_blocks.h where the weight is kept in a GGUF block format). Each row attends as one
query (a decode, or a prefill chunk's row at its position; see the C files). Op by op, a layer is ~20 torch
calls and kernel calls, each costing more than a small model's decode arithmetic for it
(bench/RESULTS.md#avx2-step, #decode-step-parts)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.cpu import kernels
from sluice.engine.cpu.matmul import Bf16Matmul, F32Matmul
from sluice.engine.cpu.ops import attention_shape_ok, kv_kind
from sluice.engine.cpu.quant import QuantMatmul, QuantPart

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class LinearSpec(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("n", _I), ("k", _I)]


class LayerSpec(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("eps", _F), ("scale", _F),
                ("qkv", LinearSpec), ("o", LinearSpec), ("gate_up", LinearSpec), ("down", LinearSpec),
                ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("cos", _P), ("sin", _P), ("num_positions", _I),
                ("k_cache", _P), ("v_cache", _P), ("num_slots", ctypes.c_long), ("sinks", _P)]


class F32LinearSpec(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("n", _I), ("k", _I), ("bf16", _I), ("parts", ctypes.POINTER(QuantPart)),
                ("num_parts", _I), ("int8", _I)]


class F32LayerSpec(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("eps", _F), ("scale", _F), ("q_norm", _P), ("k_norm", _P),
                ("qkv", F32LinearSpec), ("o", F32LinearSpec), ("gate_up", F32LinearSpec), ("down", F32LinearSpec),
                ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("cos", _P), ("sin", _P), ("num_positions", _I),
                ("k_cache", _P), ("v_cache", _P), ("num_slots", ctypes.c_long), ("sinks", _P), ("kv", _I)]


class StepSpec(ctypes.Structure):
    _fields_ = [("tokens", _I), ("hidden", _I), ("keys", _I), ("positions", _P), ("slot_mapping", _P),
                ("rows", _P), ("kv_slots", _P), ("mask", _P)]


Kernel = Bf16Matmul | F32Matmul | QuantMatmul  # (QuantMatmul: float32 stacks)


@dataclass
class DecodeLayer:
    """What the stack needs of one pre-norm Llama-family layer: its tensors in the activations' dtype (bf16 or
    float32), but the rotary tables and sinks in float32, and its linears packed for that dtype's kernel."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor
    eps: float
    qkv: Kernel  # queries, keys, values stacked
    o: Kernel
    gate_up: Kernel  # gate rows, then up rows (SwiGLU)
    down: Kernel
    heads: tuple[int, int, int]  # query heads, kv heads, head dim
    scale: float
    cos: torch.Tensor  # [positions, head dim / 2]
    sin: torch.Tensor
    k_cache: torch.Tensor  # [slots, kv heads, head dim]: the stack's dtype, or a float32 stack's bf16 / fp16 cache
    v_cache: torch.Tensor
    sinks: torch.Tensor | None  # [heads]
    q_norm: torch.Tensor | None = None  # [head dim]: per-head RMSNorm before rotary (Qwen3; float32 only)
    k_norm: torch.Tensor | None = None


class DecoderStack:
    """The layers of a model in one kernel call (see the module's doc). Built once per model and cache; it
    points into the layers' tensors and packed weights."""

    def __init__(self, fn, layers: list[DecodeLayer], hidden: int, dtype: torch.dtype) -> None:
        self.fn, self.hidden, self.count, self.dtype = fn, hidden, len(layers), dtype
        self._keep = [layer.sinks.detach().float().contiguous() if layer.sinks is not None else None
                      for layer in layers]
        specs: list[Any] = [(self._f32_spec if dtype == torch.float32 else self._bf16_spec)(layer, sinks)
                            for layer, sinks in zip(layers, self._keep)]
        self.specs = ((F32LayerSpec if dtype == torch.float32 else LayerSpec) * len(layers))(*specs)
        self._layers = layers  # (what the specs point into)

    @staticmethod
    def _common(layer: DecodeLayer, sinks: torch.Tensor | None) -> dict:
        heads, kv_heads, dim = layer.heads
        return dict(input_norm=layer.input_norm.data_ptr(), post_norm=layer.post_norm.data_ptr(), eps=layer.eps,
                    scale=layer.scale, heads=heads, kv_heads=kv_heads, head_dim=dim, cos=layer.cos.data_ptr(),
                    sin=layer.sin.data_ptr(), num_positions=layer.cos.shape[0], k_cache=layer.k_cache.data_ptr(),
                    v_cache=layer.v_cache.data_ptr(), num_slots=layer.k_cache.shape[0],
                    sinks=None if sinks is None else sinks.data_ptr())

    @classmethod
    def _bf16_spec(cls, layer: DecodeLayer, sinks: torch.Tensor | None) -> LayerSpec:
        def linear(m) -> LinearSpec:
            return LinearSpec(m.packed.data_ptr(), None if m.bias is None else m.bias.data_ptr(), m.n, m.k)

        return LayerSpec(qkv=linear(layer.qkv), o=linear(layer.o), gate_up=linear(layer.gate_up),
                         down=linear(layer.down), **cls._common(layer, sinks))

    @classmethod
    def _f32_spec(cls, layer: DecodeLayer, sinks: torch.Tensor | None) -> F32LayerSpec:
        def linear(m) -> F32LinearSpec:
            bias = None if m.bias is None else m.bias.data_ptr()
            if isinstance(m, QuantMatmul):  # (the weight kept in its block format: csrc/quant_blocks.h)
                return F32LinearSpec(None, bias, m.n, m.k, 0, m.spec, len(m.parts), int(m.int8))
            return F32LinearSpec(m.packed.data_ptr(), bias, m.n, m.k, m.mode, None, 0, 0)

        return F32LayerSpec(qkv=linear(layer.qkv), o=linear(layer.o), gate_up=linear(layer.gate_up),
                            down=linear(layer.down), q_norm=None if layer.q_norm is None else layer.q_norm.data_ptr(),
                            k_norm=None if layer.k_norm is None else layer.k_norm.data_ptr(),
                            kv=kv_kind(layer.k_cache, layer.v_cache, layer.heads[2]), **cls._common(layer, sinks))

    @classmethod
    def build(cls, layers: list[DecodeLayer]) -> "DecoderStack | None":
        """The stack, or None where a layer's shapes or dtypes are not the kernel's or it cannot run."""
        if not layers:
            return None
        dtype = layers[0].input_norm.dtype
        kernel = (F32Matmul, QuantMatmul) if dtype == torch.float32 else Bf16Matmul
        hidden = layers[0].qkv.k
        for layer in layers:
            heads, kv_heads, dim = layer.heads
            norms = [t for t in (layer.q_norm, layer.k_norm) if t is not None]
            tensors = (layer.input_norm, layer.post_norm, *norms)
            caches = (layer.k_cache, layer.v_cache)
            if (any(t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() for t in tensors)
                    or not all(t.is_contiguous() for t in caches) or kv_kind(*caches, dim) is None
                    or (dtype == torch.bfloat16 and layer.k_cache.dtype != dtype)
                    or dtype not in (torch.bfloat16, torch.float32) or (norms and dtype != torch.float32)
                    or any(t.shape != (dim,) for t in norms)
                    or not all(isinstance(m, kernel) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
                    or {layer.cos.dtype, layer.sin.dtype} != {torch.float32}
                    or not (layer.cos.is_contiguous() and layer.sin.is_contiguous())
                    or layer.cos.shape[1] != dim // 2 or not attention_shape_ok(heads, kv_heads, dim)
                    or layer.k_cache.shape[1] != kv_heads
                    or layer.input_norm.shape != (hidden,) or layer.post_norm.shape != (hidden,)
                    or (layer.qkv.k, layer.qkv.n) != (hidden, (heads + 2 * kv_heads) * dim)
                    or (layer.o.k, layer.o.n) != (heads * dim, hidden) or layer.gate_up.k != hidden
                    or layer.gate_up.n % 2 or (layer.down.k, layer.down.n) != (layer.gate_up.n // 2, hidden)):
                return None
        if dtype == torch.float32:
            fn = None if (lib := kernels.f32_step()) is None else lib.sluice_f32_layers
        else:
            fn = kernels.decoder_layers_bf16()
        return None if fn is None else cls(fn, layers, hidden, dtype)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor,
                 kv_slots: torch.Tensor, mask: torch.Tensor) -> bool:
        """Runs the layers over a step, in place on x [T, hidden] (contiguous, the stack's dtype): positions
        and slot_mapping [T], and each attention row's row of x, its keys' slots and mask (rows [T], kv_slots
        and mask [T, K]) as `decode_attention` takes them. False, with nothing done, where x is not the
        kernel's."""
        if x.dtype != self.dtype or x.device.type != "cpu" or x.shape[-1] != self.hidden or not x.is_contiguous():
            return False
        tokens, keys = kv_slots.shape
        positions, slot_mapping, rows, kv_slots = (t.contiguous() for t in (positions, slot_mapping, rows, kv_slots))
        mask = mask.reshape(tokens, keys).contiguous().view(torch.uint8)
        step = StepSpec(tokens, self.hidden, keys, positions.data_ptr(), slot_mapping.data_ptr(), rows.data_ptr(),
                        kv_slots.data_ptr(), mask.data_ptr())
        status = self.fn(self.specs, self.count, step, x.data_ptr()) if tokens else 0
        if status == -3:
            raise IndexError("a position beyond the rotary table or a slot beyond the KV cache")
        if status == -1:
            raise MemoryError("the decoder layers kernel could not allocate its workspace")
        if status:
            raise RuntimeError(f"the decoder layers kernel refused the step ({status})")
        return True
