"""gpt-oss: attention with learned sinks on alternating sliding-window / full
layers, YaRN RoPE, GQA with biases, and a top-k mixture of experts with
gpt-oss's clamped SwiGLU. Loads bf16 experts or the published MXFP4 ones
(`*_blocks` / `*_scales`), dequantized at load time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.layers import Attention, CausalLM, DecoderConfig
from sluice.engine.moe import mix
from sluice.engine.rope import Rotary

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 (two FP4 values a byte, low nibble first), scales [..., G] uint8
    (exponent + 127) -> [..., G * 32] values."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1))  # [..., G, 32]
    return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    num_experts: int
    experts_per_token: int
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_hf(cls, cfg: dict) -> "GptOssConfig":
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)]
        window = cfg.get("sliding_window") or 128
        return cls(
            **DecoderConfig.common(cfg, rms_norm_eps=1e-5, max_positions=131072),
            num_experts=cfg["num_local_experts"],
            experts_per_token=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4,
            layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
            swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
            swiglu_limit=cfg.get("swiglu_limit", 7.0),
        )


class Router(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.bias = nn.Parameter(torch.empty(c.num_experts))


class Experts(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))  # gate and up interleaved on the last dim
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))


class MoE(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        self.c = c
        self.router = Router(c)
        self.experts = Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)  # [T, E]
        top, chosen = logits.topk(self.c.experts_per_token, dim=-1)  # [T, k]
        return mix(x, chosen, top.softmax(dim=-1), self._expert)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        c, ex = self.c, self.experts
        gate_up = rows @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # [n, 2I]
        gate = gate_up[:, ::2].clamp(max=c.swiglu_limit)
        up = gate_up[:, 1::2].clamp(-c.swiglu_limit, c.swiglu_limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * c.swiglu_alpha)
        return hidden @ ex.down_proj[e] + ex.down_proj_bias[e]  # [n, H]


def _attention(c: GptOssConfig, rotary: Rotary, window: int | None) -> Attention:
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, qkv_bias=True, o_bias=True,
                     window=window, sinks=True)


class GptOssForCausalLM(CausalLM):
    config_class = GptOssConfig

    def __init__(self, c: GptOssConfig) -> None:
        super().__init__(c, _attention, MoE)

    @staticmethod
    def load_param(name: str, fetch: Callable[[str], torch.Tensor],
                   dtype: torch.dtype) -> tuple[torch.Tensor, list[str]]:
        """An expert weight from its MXFP4 `_blocks` / `_scales` pair (KeyError if the checkpoint has none)."""
        blocks, scales = fetch(name + "_blocks"), fetch(name + "_scales")
        # stored [E, out, in/32, 16]: dequantize to [E, out, in], then to the model's [E, in, out]
        return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous(), [name + "_blocks",
                                                                                       name + "_scales"]
