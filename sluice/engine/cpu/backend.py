"""The CPU backend: Sluice's C kernels where this CPU has their instructions, torch's path elsewhere.

Which CPUs get which path (chosen at run time from /proc/cpuinfo, logged once a model):

- float32 activations (the CPU default, `--dtype auto`), AVX-512F: every linear and the LM head on
  csrc/f32_matmul.c. A weight whose values are bf16 (a bf16 checkpoint) is kept in bf16 and widened in
  registers: float32 math on the same weights, half the bytes. Each decode step's layers run in one call
  (csrc/f32_layers.c: RMSNorm, q/k norms, rotary and the KV store, paged attention, SwiGLU, residuals);
  prompts' and prompt chunks' attention on csrc/causal_attention.c (flash-attention style, grouped-query
  heads together, the step's rows and the cache's slots read where they lie), their SwiGLU in the gate-and-up
  product's epilogue (the [T, 2I] product never written).
- float32 activations, AVX2 and FMA without AVX-512F: the linears and the LM head on csrc/f32_matmul_avx2.c
  (the same values, the same bf16 weights); each step's layers in one call on csrc/f32_layers.c built for
  AVX2 (the same source on 8-lane vectors); prompts too long for that step attend on csrc/causal_attention.c
  built for AVX2, and sampling's exp pass runs csrc/exp_blocks.c's AVX2 build (the same sources).
- bf16 activations, AVX512-BF16: the bf16 kernels (VDPBF16PS) for the LM head and small linears, a step
  in one call where every linear is small (csrc/decoder_layers.c); with AVX512-VNNI, greedy rows of the
  LM head screened in int8 (csrc/int8_argmax.c).
- weights kept in a GGUF block format (a GGUF file, `--quantization`), AVX512-VNNI or AVX2: csrc/quant_matmul.c
  (engine/cpu/quant.py), the weight dequantized exactly in registers; inside the one-call step too, and for
  the LM head over a quantized table and the embedding's looked-up rows (never the whole table).
- anything else (float32 without AVX2, bf16 without AVX512-BF16, float16, no C compiler,
  SLUICE_CPU_KERNELS=0): torch, with the CPU-specific choices below (oneDNN for the LM head, half-precision
  rows padded to few shapes).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.backend import Backend, LMHead
from sluice.engine.cpu import kernels, ops, quant
from sluice.engine.cpu.experts import F32Experts
from sluice.engine.cpu.lm_head import CpuLMHead
from sluice.engine.cpu.matmul import Bf16Matmul, F32Matmul, narrowed
from sluice.engine.cpu.quant import QuantMatmul, quant_linear, quant_lm_head
from sluice.engine.cpu.stack import DecodeLayer, DecoderStack
from sluice.engine.quant import QuantizedWeight
from sluice.engine.sampler import ExpKernels

log = logging.getLogger("sluice.engine")

_FP32_MAX_ROWS = 16
_SMALL_WEIGHT = 1 << 18


def row_bucket(n: int) -> int:
    """n rounded up to one of four sizes per power of two above 16 (at most 25% more)."""
    if n <= 16:
        return n
    step = (1 << (n.bit_length() - 1)) // 4
    return -(-n // step) * step


class BucketedLinear:
    """A half-precision linear through torch (oneDNN), its rows padded to `row_bucket` sizes: oneDNN compiles
    a kernel for each new shape (several times what running it costs) and keeps 1,024 of them, while a
    server's steps come in every token count up to --max-num-batched-tokens. With a small weight, up to 16
    rows run on a float32 copy of it instead (the same products, accumulated in float32 either way; oneDNN's
    bf16 matmul has a fixed cost a call that a small product does not repay; bench/RESULTS.md#cpu-kernels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        small = weight.numel() <= _SMALL_WEIGHT
        self.fp32 = (weight.detach().float(), None if bias is None else bias.detach().float()) if small else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.dtype not in (torch.bfloat16, torch.float16):
            return F.linear(x, self.weight, self.bias)
        if self.fp32 is not None and n <= _FP32_MAX_ROWS:
            return F.linear(x.float(), *self.fp32).to(x.dtype)
        if row_bucket(n) == n:
            return F.linear(x, self.weight, self.bias)
        return F.linear(F.pad(x, (0, 0, 0, row_bucket(n) - n)), self.weight, self.bias)[:n]


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the activations'

    def prepare(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        from sluice.engine.layers import Backbone  # (engine.layers imports the backends)

        super().prepare(model, kv_caches)
        self._narrow_embeddings(model)
        backbones = [m for m in model.modules() if isinstance(m, Backbone)]
        one_call = False
        for backbone in backbones:
            backbone.stack = self._stack(backbone, kv_caches)
            one_call |= backbone.stack is not None
        kinds = Counter(_kind(m.run) for m in model.modules() if hasattr(m, "run"))
        log.info("CPU backend (%s activations): linears on %s; the layers of a step in %s", str(self.dtype)[6:],
                 ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())), "one call" if one_call else "torch ops")
        return one_call

    def linear(self, layer: nn.Module):
        weight, bias = layer.weight, layer.bias
        if getattr(layer, "quant", None) is not None:  # a weight kept in a block format (engine/quant.py)
            run = quant_linear(layer.quant, bias)
            if isinstance(run, QuantMatmul):
                layer.quant = run.parts  # (those read into memory now held only repacked: RepackedWeight)
            return run
        if weight.device.type != "cpu":
            return None
        if isinstance(layer.run, (F32Matmul, Bf16Matmul)) and not weight.numel():  # (prepared before: held packed)
            return layer.run
        if self.dtype == torch.float32:
            kernel = F32Matmul.build(narrowed(weight), bias)
            if kernel is None and weight.dtype != torch.float32:  # (loaded in bf16: F.linear's, widened once)
                layer.weight.data = weight.detach().float()
            return None if kernel is None else _held_packed(layer, kernel)
        if self.dtype == torch.bfloat16 and weight.numel() <= _SMALL_WEIGHT:
            small = Bf16Matmul.build(weight, bias)
            if small is not None:
                return _held_packed(layer, small)
        return BucketedLinear(weight, bias)

    def experts(self, experts: nn.Module):
        return F32Experts.build(experts) if self.dtype == torch.float32 else None

    def exp_kernels(self) -> ExpKernels | None:
        blocks, block = kernels.exp_blocks(), kernels.exp_block()
        return ExpKernels(blocks, block) if blocks is not None and block is not None else None

    def lm_head(self, weight: torch.Tensor | QuantizedWeight) -> LMHead:
        head = quant_lm_head(weight) if isinstance(weight, QuantizedWeight) else CpuLMHead.build(weight, self.dtype)
        log.info("LM head: %s", head.path)
        return head

    def give_table(self, model: nn.Module, head: LMHead) -> None:
        """Where the head's kernel packed the table, the model's own copy goes: an untied head's weight, or a tied
        embedding's table, whose rows the embedding then reads from the packed copy (the same values: the bf16
        or float32 table the head packed, `narrowed` as the embedding was). A table held once (Qwen3-0.6B's
        tied one: 297 MB)."""
        kernel = head.kernel if isinstance(head, CpuLMHead) else None
        if getattr(model, "given_head", None) is head:
            return
        tied = model.tied_embedding() if hasattr(model, "tied_embedding") else None
        owner = tied if tied is not None else getattr(model, "lm_head", None)
        if (not isinstance(kernel, (F32Matmul, Bf16Matmul)) or owner is None
                or getattr(owner, "quant", None) is not None or (kernel.n, kernel.k) != tuple(owner.weight.shape)):
            return
        if tied is not None:
            if kernel.packed.dtype != tied.weight.dtype:
                return
            n = kernel.n

            def lookup(ids: torch.Tensor) -> torch.Tensor:
                if ids.numel() and not (0 <= int((bounds := torch.aminmax(ids)).min) and int(bounds.max) < n):
                    raise IndexError("index out of range in self")  # (nn.Embedding's; the rows past n are zero)
                return kernel.rows(ids)

            tied.lookup = lookup
        _held_packed(owner, kernel)
        head.weight = torch.empty(0)
        model.given_head = head  # (another runner over this model takes this head: ModelRunner)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        values = quant.dequantize(weight)
        return weight.dequantize() if values is None else values

    def swiglu(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kernel = gate_up.run
        if x.dtype == torch.float32 and x.device.type == "cpu":
            if isinstance(kernel, F32Matmul) and kernel.swiglu_ok:
                return kernel.swiglu(x)
            if isinstance(kernel, QuantMatmul) and kernel.n % 2 == 0 and kernels.f32_swiglu() is not None:
                out = ops.swiglu(gate_up(x))  # (a quantized product, then the one-call step's SwiGLU over it)
                assert out is not None
                return out
        return super().swiglu(gate_up, x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps) if out is None else out

    def rope_and_store(self, qk, v, heads, rotary, positions, k_cache, v_cache, slots) -> torch.Tensor:
        # (the kernels rotate every dimension, rotate-half: a partial or interleaved rotary is torch's)
        q = ops.rope_store(qk, v, heads, positions, rotary.cos, rotary.sin, slots, k_cache,
                           v_cache) if rotary.plain else None
        return super().rope_and_store(qk, v, heads, rotary, positions, k_cache, v_cache, slots) if q is None else q

    def decode_attention(self, q, k_cache, v_cache, rows, slots, mask, scale, sinks, out) -> bool:
        return ops.decode_attention(q, k_cache, v_cache, rows, slots, mask, scale, sinks, out)

    def causal_attention(self, q, k_cache, v_cache, q_index, kv_slots, out_index, scale, starts, out) -> bool:
        return ops.paged_causal_attention(q, k_cache, v_cache, q_index, kv_slots, out_index, scale, starts, out)

    def _narrow_embeddings(self, model: nn.Module) -> None:
        """Float32 embedding tables whose values are bf16 kept in bf16 (the rows read are widened: exact),
        where the float32 kernels run (the LM head tied to one then packs the bf16 values)."""
        if self.dtype != torch.float32 or F32Matmul.build(torch.zeros(1, 2)) is None:
            return
        for module in model.modules():
            if isinstance(module, nn.Embedding) and module.weight.device.type == "cpu":
                module.weight.data = narrowed(module.weight)

    def _stack(self, backbone: nn.Module, kv_caches: list) -> "StepInOneCall | None":
        """The backbone's layers as one kernel call, or None where a layer is not one the kernels run."""
        layers = [decode_layer(layer, kv) for layer, kv in zip(backbone.layers, kv_caches)]
        windows = {layer.self_attn.window for layer in backbone.layers}
        if None in layers or len(windows) != 1:
            return None
        stack = DecoderStack.build(layers)  # type: ignore[arg-type]
        return None if stack is None else StepInOneCall(stack, windows.pop())


def _kind(run) -> str:
    """What runs a linear, for the log: F.linear, or the kernel's class (the float32 one's instructions too)."""
    if run is None:
        return "F.linear"
    return f"{type(run).__name__} ({run.isa})" if hasattr(run, "isa") else type(run).__name__


def _held_packed(layer: nn.Module, kernel: F32Matmul | Bf16Matmul) -> F32Matmul | Bf16Matmul:
    """The kernel, the layer's (or a tied embedding's) weight now held only as it packed it: the layer keeps an
    empty placeholder of the packed dtype (its values, where something needs them: `kernel.rows`). A float
    linear is held once (it was twice: Qwen3-0.6B's layers 840 MB of bf16 beside their 840 MB packed)."""
    layer.weight = nn.Parameter(torch.empty(0, dtype=kernel.packed.dtype), requires_grad=False)
    return kernel


class StepInOneCall:
    """A backbone's layers over a step in one call, each row attending as one decode (`meta.row_group`)."""

    def __init__(self, stack: DecoderStack, window: int | None) -> None:
        self.stack, self.window = stack, window

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta) -> bool:
        """Runs the step in place on x; False where it does not apply (no row group, not the stack's dtype)."""
        g, w = meta.row_group, self.window
        return g is not None and self.stack(x, positions, meta.slot_mapping[w], g.q_index.view(-1), g.kv_slots[w],
                                            g.masks[w])


def decode_layer(layer: nn.Module, kv: tuple[torch.Tensor, torch.Tensor]) -> DecodeLayer | None:
    """A pre-norm Llama-family layer (sluice.engine.layers' DecoderLayer of an Attention and a GatedMLP) as the stack
    runs it, or None where it is another kind of layer or its linears do not run on one kernel. Exactly those
    classes, with only the options the kernels compute: a subclass or option (sandwich norms, GeGLU, (1 + w)
    norms, soft-capping, whole-projection q/k norms, a partial rotary) runs op by op."""
    from sluice.engine.layers import Attention, DecoderLayer, GatedMLP, RMSNorm

    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not GatedMLP:
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *([attn.q_norm, attn.k_norm] if attn.qk_norm
                                                                       else [])]
    if (any(type(n) is not RMSNorm for n in norms) or attn.softcap is not None or not attn.qk_norm_per_head
            or not attn.rotary.plain):
        return None
    eps = layer.input_layernorm.eps
    qk_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if layer.post_attention_layernorm.eps != eps or any(n is not None and n.eps != eps for n in qk_norm):
        return None
    # (a quantized weight stored in another column order reads x through it only as it quantizes x: int8)
    linears = [k for k in (attn.qkv_proj.run, attn.o_proj.run, mlp.gate_up_proj.run, mlp.down_proj.run)
               if isinstance(k, (Bf16Matmul, F32Matmul)) or isinstance(k, QuantMatmul) and (k.int8 or k.perm is None)]
    if len(linears) < 4:
        return None
    return DecodeLayer(input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                       eps=eps, qkv=linears[0], o=linears[1], gate_up=linears[2], down=linears[3], heads=attn.heads,
                       scale=attn.scale, cos=attn.rotary.cos, sin=attn.rotary.sin, k_cache=kv[0], v_cache=kv[1],
                       sinks=attn.sinks, q_norm=None if qk_norm[0] is None else qk_norm[0].weight,
                       k_norm=None if qk_norm[1] is None else qk_norm[1].weight)
