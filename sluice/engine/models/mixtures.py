"""Mixtures of experts on the Llama-family decoder: Qwen2-MoE, Qwen3-MoE and Mixtral. Each is a Llama-style
stack whose MLPs are engine/moe.py's `SparseMoE`; the families differ only in configuration:

- Qwen3-MoE: q/k norms; the top-k weights renormalised where `norm_topk_prob` says.
- Qwen2-MoE: q/k/v biases; a shared expert beside the routed ones, behind a sigmoid gate; `norm_topk_prob`.
- Mixtral: the top-k weights always renormalised (a softmax over the chosen experts' logits); an optional
  sliding window on every layer; the checkpoint's `block_sparse_moe.experts.N.w1 / w3 / w2` names.
- Qwen's `decoder_sparse_step` and `mlp_only_layers` choose which layers are mixtures (the others dense).

Checkpoints hold one tensor per expert (`mlp.experts.3.gate_proj.weight`); `load_param` stacks them into the
layer's expert tensors (transformers 5's fused `mlp.experts.gate_up_proj` loads as it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from sluice.engine.layers import CausalLM, DecoderConfig, GatedMLP
from sluice.engine.models.llama import attention
from sluice.engine.moe import SparseMoE


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps a mixture layer's tensors: the block (the model's `mlp`) and each expert's
    gate, up and down projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


@dataclass(frozen=True)
class MoeConfig(DecoderConfig):
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None  # every layer attends to this many most recent tokens (Mixtral)
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int  # each expert's (`intermediate_size`: the dense layers')
    renormalize: bool  # the top-k weights rescaled to sum to 1
    shared_expert_size: int  # the shared expert's intermediate size (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: a mixture (else a dense MLP)
    names: ExpertNames

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window,) * self.num_layers

    @classmethod
    def from_hf(cls, cfg: dict) -> "MoeConfig":
        arch = cfg["architectures"][0]
        mixtral = arch == "MixtralForCausalLM"
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window (per-layer windows) is not supported yet")
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        layers = cfg["num_hidden_layers"]
        attention_bias = bool(cfg.get("attention_bias", False))  # (Qwen2-MoE's o_proj has none)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        return cls(
            **DecoderConfig.common(cfg, rms_norm_eps=1e-5 if mixtral else 1e-6, max_positions=32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else attention_bias,
            o_bias=attention_bias and not qwen2,
            qk_norm=arch == "Qwen3MoeForCausalLM",
            sliding_window=cfg.get("sliding_window") if mixtral else None,
            num_experts=experts,
            experts_per_token=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
            renormalize=mixtral or bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=cfg.get("shared_expert_intermediate_size") or 0,
            sparse_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
            names=MIXTRAL_NAMES if mixtral else ExpertNames(),
        )


def _mlp(c: MoeConfig, sparse: bool) -> nn.Module:
    if not sparse:
        return GatedMLP(c.hidden_size, c.intermediate_size, bias=False)
    return SparseMoE(c.hidden_size, c.num_experts, c.moe_intermediate_size, c.experts_per_token, c.renormalize,
                     c.shared_expert_size)


class MoeForCausalLM(CausalLM):
    config_class = MoeConfig

    def __init__(self, c: MoeConfig) -> None:
        mlps = iter([_mlp(c, sparse) for sparse in c.sparse_layers])  # (CausalLM asks for one a layer, in order)
        super().__init__(c, attention, lambda _: next(mlps), c.tie_word_embeddings)

    def load_param(self, name: str, fetch: Callable[[str], torch.Tensor],
                   dtype: torch.dtype) -> tuple[torch.Tensor, list[str]]:
        return load_experts(name, fetch, self.config.names, self.config.num_experts)


def load_experts(name: str, fetch: Callable[[str], torch.Tensor], names: ExpertNames,
                 num_experts: int) -> tuple[torch.Tensor, list[str]]:
    """A mixture layer's tensor under the checkpoint's names: the experts' stacked from one tensor per expert
    (KeyError where the checkpoint has none)."""
    layer, _, rest = name.partition(".mlp.")  # "model.layers.3", "experts.gate_up_proj" / "gate.weight"
    if not rest:
        raise KeyError(name)
    block = f"{layer}.{names.block}"
    experts = range(num_experts)
    if rest == "experts.gate_up_proj":
        pairs = [(f"{block}.experts.{e}.{names.gate}.weight", f"{block}.experts.{e}.{names.up}.weight")
                 for e in experts]
        return torch.stack([torch.cat([fetch(g), fetch(u)]) for g, u in pairs]), [n for p in pairs for n in p]
    if rest == "experts.down_proj":
        downs = [f"{block}.experts.{e}.{names.down}.weight" for e in experts]
        return torch.stack([fetch(d) for d in downs]), downs
    return fetch(f"{block}.{rest}"), [f"{block}.{rest}"]
