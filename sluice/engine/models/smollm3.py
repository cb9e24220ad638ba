"""SmolLM3: the Llama decoder where some layers use no rotary at all (`no_rope_layers`: 1 rotates, 0 does
not; by default every `no_rope_layer_interval`-th layer does not)."""
from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.layers import Attention, CausalLM
from sluice.engine.models.llama import LlamaConfig, mlp
from sluice.engine.rope import Rotary


@dataclass(frozen=True)
class SmolLM3Config(LlamaConfig):
    rope_layers: tuple[bool, ...]  # per layer: whether it applies rotary

    @classmethod
    def from_hf(cls, cfg: dict) -> "SmolLM3Config":
        layers, interval = cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval") or 4
        flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        return cls(**vars(LlamaConfig.from_hf(cfg)), rope_layers=tuple(bool(f) for f in flags))


class SmolLM3ForCausalLM(CausalLM):
    config_class = SmolLM3Config

    def __init__(self, c: SmolLM3Config) -> None:
        # (a rotation by angle 0 is exact: these layers run the same kernels as the rotating ones)
        none = Rotary(c.head_dim, c.max_positions, c.rope_theta, {"rope_type": "none"})
        uses = iter(c.rope_layers)  # (CausalLM builds the layers in order)

        def attention(c: SmolLM3Config, rotary: Rotary, window: int | None) -> Attention:
            return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary if next(uses) else none,
                             qkv_bias=c.qkv_bias, o_bias=c.o_bias, window=window)

        super().__init__(c, attention, mlp, c.tie_word_embeddings)
