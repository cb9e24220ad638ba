"""Layers every model file builds from."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


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

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; logits_index: [B] rows whose next token is scored
        x = self.embed_tokens(input_ids)  # [T, D]
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, kv, meta)
        return self.norm(x[logits_index])  # [B, D]
