"""Layers every model file builds from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention import AttentionMetadata, paged_attention, rope_and_store
from engine.rope import Rotary, rope_params


@dataclass(frozen=True)
class DecoderConfig:
    """The fields every decoder-only model here reads from its Hugging Face config; a model family's
    config adds its own."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    rope_theta: float
    rope_scaling: dict

    @staticmethod
    def common(cfg: dict, *, rms_norm_eps: float, max_positions: int) -> dict:
        """The base fields from an HF config dict, with the family's defaults for the two often left out."""
        theta, scaling = rope_params(cfg)
        heads = cfg["num_attention_heads"]
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", rms_norm_eps),
            max_positions=cfg.get("max_position_embeddings", max_positions),
            rope_theta=theta,
            rope_scaling=scaling,
        )


def row_bucket(n: int) -> int:
    """n rounded up to one of four sizes per power of two above 16 (at most 25% more)."""
    if n <= 16:
        return n
    step = (1 << (n.bit_length() - 1)) // 4
    return -(-n // step) * step


class Linear(nn.Linear):
    """nn.Linear with three CPU paths for half-precision weights.

    - A small bf16 weight on a CPU with AVX512-BF16: Sluice's kernel (csrc/bf16_matmul.c, the LM head's),
      5-15 us a call for this project's tiny models where oneDNN's bf16 matmul costs ~17 us whatever the
      size and MKL's float32 10-60 us at 16 rows (`python -m bench.step_parts --kernels`).
    - Few rows, small weight, no kernel: a float32 copy of the weight (3-12 us at one row; the products
      are the same, accumulated in float32 either way); above `_SMALL_WEIGHT` elements, reading twice the
      bytes costs more than the call.
    - Otherwise rows are padded to `row_bucket` sizes: oneDNN compiles a kernel for each new shape
      (0.5-5 ms here, against ~0.2 ms to run it) and keeps 1,024 of them, while a server's steps come in
      every token count up to --max-num-batched-tokens: unpadded, prefill steps kept paying for it.

    What the first two derive from the weight is made again when the weight changes (a load in place)."""

    _kernel: tuple | None = None  # ((data_ptr, version) of the weight it was made from, Bf16Matmul or None)
    _fp32: tuple | None = None  # (the same, (weight, bias) in float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
            return F.linear(x, self.weight, self.bias)
        if (kernel := self.small_kernel()) is not None:
            return kernel(x)
        if self.weight.numel() <= _SMALL_WEIGHT and n <= _FP32_MAX_ROWS:
            weight, bias = self._derived("_fp32", self._float32)
            return F.linear(x.float(), weight, bias).to(x.dtype)
        if row_bucket(n) == n:
            return F.linear(x, self.weight, self.bias)
        return F.linear(F.pad(x, (0, 0, 0, row_bucket(n) - n)), self.weight, self.bias)[:n]

    def small_kernel(self) -> cpu_kernels.Bf16Matmul | None:
        """The kernel half-precision rows on the CPU go through (the first path above), or None."""
        return self._derived("_kernel", self._bf16_kernel) if self.weight.numel() <= _SMALL_WEIGHT else None

    def _derived(self, attr: str, make: Callable):
        source = (self.weight.data_ptr(), self.weight._version)
        cached = getattr(self, attr)
        if cached is None or cached[0] != source:
            cached = (source, make())
            setattr(self, attr, cached)
        return cached[1]

    def _bf16_kernel(self) -> cpu_kernels.Bf16Matmul | None:
        return cpu_kernels.Bf16Matmul.build(self.weight, self.bias)

    def _float32(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight.detach().float(), None if self.bias is None else self.bias.detach().float()


_FP32_MAX_ROWS = 16
_SMALL_WEIGHT = 1 << 18


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (out := cpu_kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return out  # bf16 on a CPU with AVX512-BF16: torch's kernel runs as ~10 ops a call here
        if x.device.type == "cpu" and x.dtype == self.weight.dtype:
            # torch's CPU kernel computes half-precision rows in float32: the same bits as below, three
            # conversions fewer
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


# Projections that read the same input run as one matmul: the model holds one stacked weight, which the
# loader builds from the checkpoint's separate tensors (concatenated on the output dimension, in order).
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stacked_parts(name: str) -> list[str]:
    """The checkpoint tensors a stacked parameter is built from ([] when `name` is not one)."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    return [f"{parent}.{part}.{leaf}" for part in STACKED.get(last, ())]


class Attention(nn.Module):
    """Self-attention over the paged cache, as the Llama family and gpt-oss share it: one stacked qkv
    projection, per-head q/k norms before rotary (Qwen3), rotary applied to q and k in one pass, an
    attention window (None: full), and per-head sink logits (gpt-oss)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: nn.Module, *,
                 qkv_bias: bool, o_bias: bool, window: int | None = None, qk_norm_eps: float | None = None,
                 sinks: bool = False) -> None:
        super().__init__()
        self.heads = (num_heads, num_kv_heads, head_dim)
        self.qkv_proj = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.rotary = rotary
        self.window = window
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h, hkv, d = self.heads
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
        qk = qkv[:, : h + hkv]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv])], dim=1)
        q = rope_and_store(qk, qkv[:, h + hkv :], h, self.rotary, positions, kv[0], kv[1],
                           meta.slot_mapping[self.window])
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(t, -1))

    def decode_parts(self, kv: tuple[torch.Tensor, torch.Tensor]) -> dict | None:
        """This layer's half of a `cpu_kernels.DecodeLayer` over the cache kv, or None where its projections
        do not run on the bf16 kernel (or it has q/k norms, which the fused decode does not run)."""
        qkv, o = self.qkv_proj.small_kernel(), self.o_proj.small_kernel()
        if qkv is None or o is None or self.qk_norm:
            return None
        return dict(qkv=qkv, o=o, heads=self.heads, scale=self.scale, cos=self.rotary.cos, sin=self.rotary.sin,
                    k_cache=kv[0], v_cache=kv[1], sinks=self.sinks)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Names follow HF checkpoints."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, x, positions, kv, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_layer(self, kv: tuple[torch.Tensor, torch.Tensor]) -> cpu_kernels.DecodeLayer | None:
        """The layer as csrc/decoder_layers.c runs it, or None where it cannot (an MLP without
        `decode_parts`, such as a mixture of experts, or an attention without them)."""
        mlp = getattr(self.mlp, "decode_parts", lambda: None)()
        attn = getattr(self.self_attn, "decode_parts", lambda kv: None)(kv)
        if mlp is None or attn is None or self.input_layernorm.eps != self.post_attention_layernorm.eps:
            return None
        return cpu_kernels.DecodeLayer(input_norm=self.input_layernorm.weight,
                                       post_norm=self.post_attention_layernorm.weight, eps=self.input_layernorm.eps,
                                       **attn, **mlp)


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm; returns the normed hidden states of the rows asked for."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; logits_index: [B] rows whose next token is scored
        x = self.embed_tokens(input_ids)  # [T, D]
        if not self._in_one_call(x, positions, kv_caches, meta):
            for layer, kv in zip(self.layers, kv_caches):
                x = layer(x, positions, kv, meta)
        return self.norm(x[logits_index])  # [B, D]

    _stack: tuple | None = None  # (what it was built from, DecoderStack or None, the layers' window)
    _params: list | None = None

    def _in_one_call(self, x: torch.Tensor, positions, kv_caches: list, meta: AttentionMetadata) -> bool:
        """The step through every layer in one kernel call (cpu_kernels.DecoderStack), in place on x, each
        row attending as one decode (`meta.row_group`); False where it does not apply."""
        g = meta.row_group
        if g is None or x.dtype != torch.bfloat16:
            return False
        if self._params is None:
            self._params = list(self.parameters())
        # rebuilt when a weight is loaded in place (the packed copies change) or the caches are not the same
        source = (*((p.data_ptr(), p._version) for p in self._params),
                  *((t.data_ptr(), t.shape[0]) for kv in kv_caches for t in kv))
        if self._stack is None or self._stack[0] != source:
            layers = [layer.decode_layer(kv) for layer, kv in zip(self.layers, kv_caches)]
            windows = {layer.self_attn.window for layer in self.layers}
            stack = cpu_kernels.DecoderStack.build(layers) if None not in layers and len(windows) == 1 else None
            self._stack = (source, stack, windows.pop())
        _, stack, window = self._stack
        if stack is None:
            return False
        return stack(x, positions, meta.slot_mapping[window], g.q_index.view(-1), g.kv_slots[window],
                     g.masks[window])


class CausalLM(nn.Module):
    """A decoder-only model: `self.model` (a Backbone of pre-norm layers, one per entry of the config's
    `layer_windows`) and `self.lm_head`, unless the LM head is tied to the embedding. Its forward gives the
    hidden states the runner's LM head scores. `attention(config, rotary, window)` and `mlp(config)` build
    each layer's two halves."""

    def __init__(self, c, attention: Callable, mlp: Callable, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.config = c
        rotary = Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling)
        self.model = Backbone(c.vocab_size, c.hidden_size, c.rms_norm_eps, [
            DecoderLayer(c.hidden_size, c.rms_norm_eps, attention(c, rotary, w), mlp(c)) for w in c.layer_windows])
        if not tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention)."""
        return self.config.layer_windows

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the paged cache."""
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    def lm_weight(self) -> torch.Tensor:
        return self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata, logits_index) -> torch.Tensor:
        """The normed hidden states [B, D] of the rows in `logits_index`."""
        return self.model(input_ids, positions, kv_caches, meta, logits_index)
