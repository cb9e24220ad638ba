"""Granite (3.x dense): the Llama decoder with four multipliers: the embeddings' (`embedding_multiplier`),
the attention scores' in place of head_dim**-0.5 (`attention_multiplier`), each block's output before its
residual add (`residual_multiplier`), and the logits divided by `logits_scaling`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.layers import Attention, CausalLM, NormedLayer, NormNames
from sluice.engine.models.llama import LlamaConfig, mlp
from sluice.engine.rope import Rotary


@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float
    attention_multiplier: float
    residual_multiplier: float
    logits_scaling: float

    @classmethod
    def from_hf(cls, cfg: dict) -> "GraniteConfig":
        return cls(**vars(LlamaConfig.from_hf(cfg)),
                   embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                   attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                   residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                   logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def _attention(c: GraniteConfig, rotary: Rotary, window: int | None) -> Attention:
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, qkv_bias=c.qkv_bias,
                     o_bias=c.o_bias, window=window, scale=c.attention_multiplier)


class GraniteForCausalLM(CausalLM):
    config_class = GraniteConfig

    def __init__(self, c: GraniteConfig) -> None:
        super().__init__(c, _attention, mlp, c.tie_word_embeddings, embed_scale=c.embedding_multiplier,
                         layer=lambda c, attn, mlp: NormedLayer(c.hidden_size, c.rms_norm_eps, attn, mlp, NormNames(),
                                                                residual_scale=c.residual_multiplier))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.config.logits_scaling
