"""OLMo 2: the Llama decoder with its norms after the attention and the MLP instead of before them
(x + norm(attn(x)), x + norm(mlp(x))), and q/k norms over each whole projection (all heads together)."""
from __future__ import annotations

from sluice.engine.layers import Attention, CausalLM, NormedLayer, NormNames
from sluice.engine.models.llama import LlamaConfig, mlp
from sluice.engine.rope import Rotary

POST_NORMS = NormNames(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


def _attention(c: LlamaConfig, rotary: Rotary, window: int | None) -> Attention:
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, qkv_bias=c.qkv_bias,
                     o_bias=c.o_bias, window=window, qk_norm_eps=c.rms_norm_eps, qk_norm_per_head=False)


class Olmo2ForCausalLM(CausalLM):
    config_class = LlamaConfig

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__(c, _attention, mlp, c.tie_word_embeddings,
                         layer=lambda c, attn, mlp: NormedLayer(c.hidden_size, c.rms_norm_eps, attn, mlp, POST_NORMS))
