"""Gemma 2 and Gemma 3 (text): the Llama decoder with

- sandwich norms: RMSNorm before and after both the attention and the MLP, each scaled by (1 + weight);
- GeGLU (gelu, tanh approximation) in place of SwiGLU, and embeddings scaled by sqrt(hidden);
- sliding-window and full attention layers interleaved (`layer_types`), scores scaled by
  query_pre_attn_scalar**-0.5;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q/k norms per head, and the sliding layers' rotary on a base of their own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.layers import Attention, CausalLM, DecoderConfig, GeGLU, NormedLayer, NormNames, OffsetRMSNorm
from sluice.engine.rope import Rotary, rope_params

SANDWICH = NormNames("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm")


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    tie_word_embeddings: bool
    attention_bias: bool
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: bool
    local_rope: tuple[float, dict] | None  # the sliding layers' (theta, scaling), where not the full layers'

    @classmethod
    def from_hf(cls, cfg: dict) -> "GemmaConfig":
        arch = cfg["architectures"][0]
        gemma3 = arch == "Gemma3ForCausalLM"
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{arch} with activation {act!r} is not supported (only gelu_pytorch_tanh)")
        layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (6 if gemma3 else 2)
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                           for i in range(layers)]
        window = cfg.get("sliding_window") or 4096
        full, local = cfg, None
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: one rope dict per layer type
            full = {**cfg, "rope_parameters": params["full_attention"], "rope_scaling": None}
            local = rope_params({"rope_parameters": params.get("sliding_attention") or params["full_attention"]})
        elif gemma3:
            local = (float(cfg.get("rope_local_base_freq", 10000.0)), {"rope_type": "default"})
        return cls(
            **DecoderConfig.common(full, rms_norm_eps=1e-6, max_positions=8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            qk_norm=gemma3,
            local_rope=local,
        )


class GemmaForCausalLM(CausalLM):
    config_class = GemmaConfig

    def __init__(self, c: GemmaConfig) -> None:
        local = None if c.local_rope is None else Rotary(c.head_dim, c.max_positions, *c.local_rope)

        def attention(c: GemmaConfig, rotary: Rotary, window: int | None) -> Attention:
            return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                             local if window is not None and local is not None else rotary,
                             qkv_bias=c.attention_bias, o_bias=c.attention_bias, window=window,
                             qk_norm_eps=c.rms_norm_eps if c.qk_norm else None, norm=OffsetRMSNorm,
                             scale=c.query_pre_attn_scalar**-0.5, softcap=c.attn_softcap)

        super().__init__(c, attention, lambda c: GeGLU(c.hidden_size, c.intermediate_size, bias=False),
                         c.tie_word_embeddings, norm=OffsetRMSNorm, embed_scale=c.hidden_size**0.5,
                         layer=lambda c, attn, mlp: NormedLayer(c.hidden_size, c.rms_norm_eps, attn, mlp, SANDWICH,
                                                                OffsetRMSNorm))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_softcap
        return logits if cap is None else (logits / cap).tanh_().mul_(cap)
