"""The Llama family: Llama, Mistral, Qwen2, Qwen3 and Phi-3 (RMSNorm, RoPE, GQA,
SwiGLU, optional qk-norm, q/k/v biases, tied embeddings, a sliding window). Phi-3's
checkpoints hold the stacked qkv_proj and gate_up_proj as they are here, and its
LongRoPE and partial rotary are engine/rope.py's.

Parameter names follow the Hugging Face checkpoints, so the generic loader maps
tensors one to one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluice.engine.layers import Attention, CausalLM, DecoderConfig, GatedMLP
from sluice.engine.rope import Rotary


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # every layer attends to this many most recent tokens (Mistral-style)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window,) * self.num_layers

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        arch = cfg["architectures"][0]
        attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window (per-layer windows) is not supported yet")
        return cls(
            **DecoderConfig.common(cfg, rms_norm_eps=1e-6, max_positions=4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=cfg.get("sliding_window") if arch in ("MistralForCausalLM", "Phi3ForCausalLM") else None,
        )


def mlp(c: LlamaConfig) -> GatedMLP:
    return GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)


class AttentionShape(Protocol):
    """What a Llama-family attention is built from (the dense config's fields, and a mixture's)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...


def attention(c: AttentionShape, rotary: Rotary, window: int | None) -> Attention:
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, qkv_bias=c.qkv_bias,
                     o_bias=c.o_bias, window=window, qk_norm_eps=c.rms_norm_eps if c.qk_norm else None)


class LlamaForCausalLM(CausalLM):
    config_class = LlamaConfig

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__(c, attention, mlp, c.tie_word_embeddings)
