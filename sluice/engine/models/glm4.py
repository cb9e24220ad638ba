"""GLM-4 (0414): the Llama decoder with sandwich norms (before and after both the attention and the MLP),
rotary on part of each head (`partial_rotary_factor`, a half) pairing dimensions 2i and 2i + 1, q/k/v biases
without an output bias, and the checkpoint's gate and up projections already stacked (`gate_up_proj`)."""
from __future__ import annotations

from sluice.engine.layers import Attention, CausalLM, NormedLayer, NormNames
from sluice.engine.models.llama import LlamaConfig, mlp
from sluice.engine.rope import Rotary

GLM4_NORMS = NormNames("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                       "post_mlp_layernorm")


def _attention(c: LlamaConfig, rotary: Rotary, window: int | None) -> Attention:
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, qkv_bias=c.qkv_bias,
                     o_bias=False, window=window)


class Glm4ForCausalLM(CausalLM):
    config_class = LlamaConfig

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__(c, _attention, mlp, c.tie_word_embeddings,
                         rotary=Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling, interleaved=True),
                         layer=lambda c, attn, mlp: NormedLayer(c.hidden_size, c.rms_norm_eps, attn, mlp, GLM4_NORMS))
