"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 (RMSNorm, RoPE, GQA,
SwiGLU, optional qk-norm, q/k/v biases, tied embeddings, a sliding window).

Parameter names follow the Hugging Face checkpoints, so the generic loader maps
tensors one to one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.layers import Backbone, DecoderLayer, Linear, RMSNorm, split_qkv
from engine.rope import Rotary, rope_params


@dataclass(frozen=True)
class LlamaConfig:
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
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # every layer attends to this many most recent tokens (Mistral-style)

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        arch = cfg["architectures"][0]
        theta, scaling = rope_params(cfg)
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window (per-layer windows) is not supported yet")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_positions=cfg.get("max_position_embeddings", 4096),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        self.c = c
        self.heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        self.qkv_proj = Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.qkv_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = rotary
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.scale = c.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        norms = (self.q_norm, self.k_norm) if self.c.qk_norm else None
        q, k, v = split_qkv(self.qkv_proj(x), self.heads, self.rotary, positions, norms)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, window=self.c.sliding_window)
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaForCausalLM(nn.Module):
    config_class = LlamaConfig

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        rotary = Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling)
        self.model = Backbone(c.vocab_size, c.hidden_size, c.rms_norm_eps, [
            DecoderLayer(c.hidden_size, c.rms_norm_eps, Attention(c, rotary), MLP(c)) for _ in range(c.num_layers)])
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the paged cache."""
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention)."""
        return (self.config.sliding_window,) * self.config.num_layers

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata, logits_index) -> torch.Tensor:
        """The normed hidden states [B, D] of the rows in `logits_index` (the runner's LM head scores them)."""
        return self.model(input_ids, positions, kv_caches, meta, logits_index)
