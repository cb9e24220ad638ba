"""DeepSeek-V2 (and V2-Lite, V2.5) and DeepSeek-V3 (and R1, Kimi-K2, which share its architecture): the Llama
decoder with

- multi-head latent attention (MLA): each token's keys and values are up-projected from one compressed latent
  (`kv_lora_rank` wide, RMS-normed) that all heads share, beside one rotary key (`qk_rope_head_dim`) that all
  heads share too; the queries come through a low-rank pair of their own (`q_lora_rank`; V2-Lite has none);
- the paged cache holds only the latent and the rotary key per token per layer (kv_lora_rank +
  qk_rope_head_dim values), not the expanded keys and values: the key up-projection is absorbed into each
  head's query, the value up-projection applied after attention, so attention runs over the latent itself
  (one cache tensor serving as keys and values, one kv head);
- decoupled RoPE: only the rotary part of each head is rotated, its dimensions paired 2i / 2i + 1 (V3: unless
  `rope_interleave` is false), with YaRN scaling whose `mscale_all_dim` also scales the attention scores;
- mixtures of experts (engine/moe.py) after the first `first_k_dense_replace` dense layers, with shared
  experts every token runs and the routed experts' weights times `routed_scaling_factor`. V2 routes by
  softmax, group-limited where `topk_method` says (the experts in `n_group` groups, a token choosing among the
  `topk_group` groups whose best expert scores highest). V3 (`noaux_tc`) scores each expert by a sigmoid,
  chooses by those scores plus a learned per-expert bias (`e_score_correction_bias`, for load balance) among
  the `topk_group` groups whose best two such scores sum highest, weights the chosen by their uncorrected
  scores, renormalised where `norm_topk_prob` says.

V3 differs from V2 only in that configuration: one model class serves both architectures.
Parameter names follow the Hugging Face checkpoints (`self_attn.kv_a_proj_with_mqa`, `mlp.shared_experts`,
`mlp.gate.e_score_correction_bias`).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from sluice.engine.attention import AttentionMetadata, store_rows
from sluice.engine.backend import TORCH, Backend
from sluice.engine.layers import CausalLM, DecoderConfig, GatedMLP, Linear, RMSNorm, stacked_parts
from sluice.engine.models.mixtures import ExpertNames, load_experts
from sluice.engine.moe import SparseMoE
from sluice.engine.rope import Rotary, yarn_mscale

log = logging.getLogger("sluice.engine")

_LATENT_NORM_EPS = 1e-6  # (the q and kv latents' norms take no eps from the config)
# greedy: the top k of all experts; group_limited_greedy: of the best groups (V2); noaux_tc: of the best groups
# by corrected scores (V3)
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DeepseekV2Config(DecoderConfig):
    tie_word_embeddings: bool
    attention_bias: bool
    q_lora_rank: int | None  # None: queries projected directly (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # the rotary dimensions paired 2i / 2i + 1 (else i / i + rope/2)
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_experts: int
    renormalize: bool
    routed_scale: float
    groups: tuple[int, int] | None  # (n_group, topk_group) for group-limited routing
    sigmoid: bool  # each expert scored by its own sigmoid (V3), else a softmax over the experts
    corrected: bool  # the router's e_score_correction_bias added to the scores that choose (V3's noaux_tc)
    sparse_layers: tuple[bool, ...]
    mtp_layers: int  # multi-token prediction layers after the last (V3), which only speculative decoding runs

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return (None,) * self.num_layers

    @property
    def scale(self) -> float:
        """The attention scores' scale: 1/sqrt(q/k head dim), times YaRN's mscale_all_dim temperature squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s["rope_type"] != "default" and s.get("mscale_all_dim"):
            scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
        return scale

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV2Config":
        arch = cfg["architectures"][0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        v3 = arch == "DeepseekV3ForCausalLM"  # (its transformers config leaves the routing it implies unsaid)
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if method not in _TOPK_METHODS or scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{arch} with topk_method {method!r} / scoring_func {scoring!r} is not supported "
                             f"(topk_method {' or '.join(_TOPK_METHODS)}, over softmax or sigmoid scores)")
        layers, experts = cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
        dense, every = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        rope = cfg["qk_rope_head_dim"]
        return cls(
            **{**DecoderConfig.common(cfg, rms_norm_eps=1e-6, max_positions=2048),
               "head_dim": cfg["qk_nope_head_dim"] + rope, "num_kv_heads": 1},
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=rope,
            v_head_dim=cfg["v_head_dim"],
            rope_interleaved=not v3 or bool(cfg.get("rope_interleave", True)),
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            shared_experts=cfg.get("n_shared_experts") or 0,
            # (V2's router never renormalises, whatever norm_topk_prob says, as transformers')
            renormalize=v3 and bool(cfg.get("norm_topk_prob", True)),
            routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
            groups=_groups(cfg) if method != "greedy" else None,
            sigmoid=scoring == "sigmoid",
            corrected=method == "noaux_tc",
            sparse_layers=tuple(experts > 0 and i >= dense and i % every == 0 for i in range(layers)),
            mtp_layers=cfg.get("num_nextn_predict_layers") or 0,
        )


def _groups(cfg: dict) -> tuple[int, int] | None:
    n, m = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    return (n, m) if m < n else None  # (every group kept: plain top-k, as Kimi-K2's one group)


class LatentAttention(nn.Module):
    """Multi-head latent attention over a paged cache of latents (see the module's doc)."""

    backend: Backend = TORCH

    def __init__(self, c: DeepseekV2Config, rotary: Rotary) -> None:
        super().__init__()
        h, nope, rope, v = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.dims = (h, nope, rope, v, c.kv_lora_rank)
        self.q_lora = c.q_lora_rank is not None
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, h * (nope + rope), bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(c.q_lora_rank, h * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + rope, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, _LATENT_NORM_EPS)
        # (an nn.Linear, never run as one: its two halves are absorbed into the queries and the outputs)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (nope + v), bias=False)
        self.o_proj = Linear(h * v, c.hidden_size, bias=c.attention_bias)
        self.rotary = rotary
        self.scale = c.scale
        self.window = None  # (full attention: what the backend asks of every layer)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, H * (nope + rope)]
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h, nope, rope, v, rank = self.dims
        t = x.shape[0]
        q_nope, q_rope = self._queries(x).view(t, h, nope + rope).split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)  # [T, R], [T, rope]
        rotated = self.rotary(torch.cat([q_rope, k_rope.unsqueeze(1)], dim=1), positions)  # [T, H + 1, rope]
        cache = kv[0]  # [slots, 1, R + rope]: the latent, then the rotary key (kv[1] is the same tensor)
        store_rows(cache, meta.slot_mapping[None],
                   torch.cat([self.kv_a_layernorm(latent), rotated[:, h]], dim=-1).unsqueeze(1))
        w_kv = self.kv_b_proj.weight.view(h, nope + v, rank).to(x.dtype)
        w_k, w_v = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, R], [H, v, R]
        # q . k = (q_nope W_k) . latent + q_rope . k_rope: each head's query in latent space, then its rotary part
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1), rotated[:, :h]], dim=-1)
        o = self.backend.paged_attention(q.contiguous(), cache, cache, meta, self.scale, None, None)  # [T, H, R+rope]
        out = torch.bmm(o[..., :rank].transpose(0, 1), w_v.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(t, h * v))


def _mlp(c: DeepseekV2Config, sparse: bool) -> nn.Module:
    if not sparse:
        return GatedMLP(c.hidden_size, c.intermediate_size, bias=False)
    return SparseMoE(c.hidden_size, c.num_experts, c.moe_intermediate_size, c.experts_per_token, c.renormalize,
                     c.moe_intermediate_size * c.shared_experts, groups=c.groups, scale=c.routed_scale,
                     shared_gate=False, sigmoid=c.sigmoid, corrected=c.corrected)


class DeepseekV2ForCausalLM(CausalLM):
    config_class = DeepseekV2Config
    latent_kv = True

    def __init__(self, c: DeepseekV2Config) -> None:
        rotary = Rotary(c.qk_rope_head_dim, c.max_positions, c.rope_theta, c.rope_scaling,
                        interleaved=c.rope_interleaved)
        mlps = iter([_mlp(c, sparse) for sparse in c.sparse_layers])  # (CausalLM asks for one a layer, in order)
        super().__init__(c, lambda c, rotary, _: LatentAttention(c, rotary), lambda _: next(mlps),
                         c.tie_word_embeddings, rotary=rotary)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, 1, the latent and the rotary key): one latent per token, every head's keys and values."""
        c = self.config
        return c.num_layers, 1, c.kv_lora_rank + c.qk_rope_head_dim

    def load_param(self, name: str, fetch: Callable[[str], torch.Tensor],
                   dtype: torch.dtype) -> tuple[torch.Tensor, list[str]]:
        """The shared experts under the checkpoint's name (`shared_experts`, gate and up stacked), and the
        routed experts stacked (engine/models/mixtures.py)."""
        if ".mlp.shared_expert." in name:
            theirs = name.replace(".shared_expert.", ".shared_experts.")
            parts = stacked_parts(theirs) or [theirs]
            return torch.cat([fetch(p) for p in parts]), parts
        return load_experts(name, fetch, ExpertNames(), self.config.num_experts)

    def unused_tensors(self, names: set[str]) -> set[str]:
        """Of the checkpoint's tensors the model did not load, those of the multi-token prediction layers
        (`num_nextn_predict_layers`, numbered after the last layer): not served, and skipped with a log line."""
        first = self.config.num_layers
        mtp = {n for n in names if (m := _LAYER.match(n)) and first <= int(m[1]) < first + self.config.mtp_layers}
        if mtp:
            log.info("skipping the %d tensors of %d multi-token prediction layer(s) (model.layers.%d...): "
                     "speculative decoding by them is not served", len(mtp), self.config.mtp_layers, first)
        return mtp
