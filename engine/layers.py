"""Layers every model file builds from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.backend import TORCH, Backend
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


class Linear(nn.Linear):
    """nn.Linear whose product its backend may run: `run`, set once by `Backend.prepare` (a kernel over the
    weight packed at load, where the backend has one); F.linear otherwise."""

    run: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.run is None else self.run(x)


class RMSNorm(nn.Module):
    backend: Backend = TORCH

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one stacked projection (gate rows first)."""

    backend: Backend = TORCH

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.swiglu(self.gate_up_proj, x))


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

    backend: Backend = TORCH

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
        q = self.backend.rope_and_store(qk, qkv[:, h + hkv :], h, self.rotary, positions, kv[0], kv[1],
                                        meta.slot_mapping[self.window])
        o = self.backend.paged_attention(q, kv[0], kv[1], meta, self.scale, self.window, self.sinks)
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
        x = x + self.self_attn(self.input_layernorm(x), positions, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm; returns the normed hidden states of the rows asked for."""

    # The layers of a step in one call, where the backend has one (set by `Backend.prepare`): (x, positions,
    # meta) -> whether it ran, in place on x.
    stack: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], bool] | None = None

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: list[nn.Module]) -> None:
        super().__init__()
        # (no random init: the checkpoint fills it; normal_ on the meta device imports torch's compiler, 1 s)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; logits_index: [B] rows whose next token is scored
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # [T, D] (a table kept narrower: widened)
        if self.stack is None or not self.stack(x, positions, meta):
            for layer, kv in zip(self.layers, kv_caches):
                x = layer(x, positions, kv, meta)
        return self.norm(x[logits_index])  # [B, D]


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
