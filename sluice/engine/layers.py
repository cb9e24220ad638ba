"""Layers every model file builds from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.attention import AttentionMetadata
from sluice.engine.backend import TORCH, Backend
from sluice.engine.quant import QuantizedWeight
from sluice.engine.rope import Rotary, rope_params


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


class Linear(nn.Linear):
    """nn.Linear whose product its backend may run: `run`, set once by `Backend.prepare` (a kernel over the
    weight packed at load, where the backend has one); F.linear otherwise."""

    run: Callable[[torch.Tensor], torch.Tensor] | None = None
    quant = None  # an engine.quant.QuantizedWeight in place of `weight` (engine.quant.set_quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.run is not None:
            return self.run(x)
        # (a weight kept narrower than x, as a bf16 checkpoint's is under float32 on the CPU: widened here,
        # where no kernel runs it)
        return F.linear(x, self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype), self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be kept in a GGUF block format (`quant`, set by engine.quant.set_quantized):
    then only the rows looked up are dequantized (by the backend's kernel where it has one), never the table.
    A table tied to the LM head may be held only as the head's kernel packed it (`lookup`, set by the backend's
    `give_table`)."""

    backend: Backend = TORCH
    quant = None  # (an engine.quant.QuantizedWeight,) in place of `weight`
    lookup: Callable[[torch.Tensor], torch.Tensor] | None = None  # ids [T] -> rows [T, D], in place of `weight`

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            rows = self.lookup(ids.reshape(-1))
            return rows.view(*ids.shape, rows.shape[-1])
        if self.quant is None:
            return super().forward(ids)
        return self.backend.dequantize(self.quant[0].rows(ids.reshape(-1))).view(*ids.shape, -1)  # float32


class RMSNorm(nn.Module):
    backend: Backend = TORCH

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), as Gemma's checkpoints store it (1 + weight in float32, as transformers
    computes it: in bf16 it would round)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight.float() + 1, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one stacked projection (gate rows first)."""

    backend: Backend = TORCH

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.swiglu(self.gate_up_proj, x))


class GeGLU(GatedMLP):
    """GatedMLP with gelu (tanh approximation) in place of silu: down(gelu(gate(x)) * up(x)) (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


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
    projection, q/k norms before rotary (per head, Qwen3; or over each whole projection, `qk_norm_per_head`
    False: OLMo 2), rotary applied to q and k in one pass, an attention window (None: full), per-head sink
    logits (gpt-oss), a score scale other than head_dim**-0.5 (`scale`) and scores soft-capped as
    softcap * tanh(s / softcap) (Gemma 2)."""

    backend: Backend = TORCH

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: nn.Module, *,
                 qkv_bias: bool, o_bias: bool, window: int | None = None, qk_norm_eps: float | None = None,
                 sinks: bool = False, qk_norm_per_head: bool = True, norm: type[RMSNorm] = RMSNorm,
                 scale: float | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.heads = (num_heads, num_kv_heads, head_dim)
        self.qkv_proj = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm_eps is not None
        self.qk_norm_per_head = qk_norm_per_head
        if qk_norm_eps is not None:
            self.q_norm = norm(head_dim if qk_norm_per_head else num_heads * head_dim, qk_norm_eps)
            self.k_norm = norm(head_dim if qk_norm_per_head else num_kv_heads * head_dim, qk_norm_eps)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.rotary = rotary
        self.window = window
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h, hkv, d = self.heads
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
        qk = qkv[:, : h + hkv]
        if self.qk_norm and self.qk_norm_per_head:
            qk = torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv])], dim=1)
        elif self.qk_norm:  # [T, H * D] and [T, Hkv * D] normed whole
            qk = torch.cat([self.q_norm(qkv[:, :h].reshape(t, -1)).view(t, h, d),
                            self.k_norm(qkv[:, h : h + hkv].reshape(t, -1)).view(t, hkv, d)], dim=1)
        q = self.backend.rope_and_store(qk, qkv[:, h + hkv :], h, self.rotary, positions, kv[0], kv[1],
                                        meta.slot_mapping[self.window])
        o = self.backend.paged_attention(q, kv[0], kv[1], meta, self.scale, self.window, self.sinks, self.softcap)
        return self.o_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Names follow HF checkpoints."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, x, positions, kv, meta: AttentionMetadata) -> torch.Tensor:
        # (the residual adds in place: x is the step's own, and a prompt's [T, D] is worth no copy per add)
        x.add_(self.self_attn(self.input_layernorm(x), positions, kv, meta))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


@dataclass(frozen=True)
class NormNames:
    """Which norms a `NormedLayer` has around its attention and its MLP, under the checkpoint's names (None:
    no such norm). Llama's: one before each; Gemma's sandwich: one before and one after each; OLMo 2's: after
    each only."""

    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


class NormedLayer(nn.Module):
    """A residual block whose norms are the family's (`NormNames`): x + out(attn(in(x))) * residual_scale,
    then the same around the MLP (each missing norm the identity)."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module, names: NormNames,
                 norm: type[RMSNorm] = RMSNorm, residual_scale: float = 1.0) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.names = (names.attn_in, names.attn_out, names.mlp_in, names.mlp_out)
        for name in self.names:
            if name is not None:
                self.add_module(name, norm(hidden_size, eps))
        self.residual_scale = residual_scale

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else self.get_submodule(name)(x)

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def forward(self, x, positions, kv, meta: AttentionMetadata) -> torch.Tensor:
        attn_in, attn_out, mlp_in, mlp_out = self.names
        # (the residual adds in place, as DecoderLayer's)
        x.add_(self._scaled(self._norm(attn_out, self.self_attn(self._norm(attn_in, x), positions, kv, meta))))
        return x.add_(self._scaled(self._norm(mlp_out, self.mlp(self._norm(mlp_in, x)))))


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm; returns the normed hidden states of the rows asked for."""

    # The layers of a step in one call, where the backend has one (set by `Backend.prepare`): (x, positions,
    # meta) -> whether it ran, in place on x.
    stack: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], bool] | None = None

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: list[nn.Module],
                 norm: type[RMSNorm] = RMSNorm, embed_scale: float = 1.0) -> None:
        super().__init__()
        # (no random init: the checkpoint fills it; normal_ on the meta device imports torch's compiler, 1 s)
        self.embed_tokens = Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = norm(hidden_size, eps)
        self.embed_scale = embed_scale  # the embeddings' multiplier (Gemma: sqrt(hidden); Granite's own)

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; logits_index: [B] rows whose next token is scored
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # [T, D] (a table kept narrower: widened)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # (rounded to x's dtype, as the checkpoints')
        if self.stack is None or not self.stack(x, positions, meta):
            for layer, kv in zip(self.layers, kv_caches):
                x = layer(x, positions, kv, meta)
        return self.norm(x[logits_index])  # [B, D]


class CausalLM(nn.Module):
    """A decoder-only model: `self.model` (a Backbone of pre-norm layers, one per entry of the config's
    `layer_windows`) and `self.lm_head`, unless the LM head is tied to the embedding. Its forward gives the
    hidden states the runner's LM head scores. `attention(config, rotary, window)` and `mlp(config)` build
    each layer's two halves; `layer(config, attention, mlp)` the layer around them (Llama's `DecoderLayer`
    unless given), `norm` the norms' kind, `embed_scale` the embeddings' multiplier and `rotary` the rotary
    embedding (the config's, rotate-half, unless given)."""

    def __init__(self, c, attention: Callable, mlp: Callable, tie_word_embeddings: bool = False, *,
                 layer: Callable | None = None, norm: type[RMSNorm] = RMSNorm, embed_scale: float = 1.0,
                 rotary: Rotary | None = None) -> None:
        super().__init__()
        self.config = c
        self.rotary = rotary = rotary or Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling)
        layer = layer or (lambda c, attn, mlp: DecoderLayer(c.hidden_size, c.rms_norm_eps, attn, mlp))
        self.model = Backbone(c.vocab_size, c.hidden_size, c.rms_norm_eps, [
            layer(c, attention(c, rotary, w), mlp(c)) for w in c.layer_windows], norm, embed_scale)
        if not tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [B, V] as the model scores them (Gemma 2 soft-caps them, Granite scales
        them); as they are unless a family says otherwise. Must keep each row's order: a greedy row's token
        comes from the LM head's argmax, without it."""
        return logits

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention)."""
        return self.config.layer_windows

    # Whether each layer's cache is one tensor that serves as both its keys and its values (multi-head latent
    # attention's latent), rather than a pair: the runner then allocates it once.
    latent_kv = False

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the paged cache."""
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    def tied_embedding(self) -> Embedding | None:
        """The embedding whose table is the LM head's (tied), else None."""
        return None if hasattr(self, "lm_head") else self.model.embed_tokens

    def lm_weight(self) -> torch.Tensor | QuantizedWeight:
        """The LM head's table [V, D]: its own or the embedding's, kept quantized where it is (the backend's
        `lm_head` multiplies by it as it lies)."""
        if (given := getattr(self, "given_head", None)) is not None:  # (the table held by a head: Backend.give_table)
            return given.values()
        tied = self.tied_embedding()
        head = self.lm_head if tied is None else tied
        quant = getattr(head, "quant", None)
        return head.weight if quant is None else quant[0]

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata, logits_index) -> torch.Tensor:
        """The normed hidden states [B, D] of the rows in `logits_index`."""
        # (the layers see each token's rotary table row: its position, but for LongRoPE's long factors)
        return self.model(input_ids, self.rotary.rows(positions, meta), kv_caches, meta, logits_index)
