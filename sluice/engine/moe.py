"""A mixture of experts: a router scores every expert for each token, the top k run, and their outputs are
summed, weighted by the router's probabilities. Only the chosen experts compute, each once, on the rows
routed to it: a step's cost grows with the experts its tokens choose, not with the experts the layer holds.

Qwen2-MoE, Qwen3-MoE and Mixtral are `SparseMoE` under different configurations (engine/models/mixtures.py),
and so are DeepSeek-V2's and V3's mixtures (engine/models/deepseek_v2.py), V3's routing by sigmoid scores
with a load-balancing correction;
gpt-oss keeps its own experts and routing (engine/models/gpt_oss.py) and shares `mix`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.layers import GatedMLP, Linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool, groups: tuple[int, int] | None = None,
          scale: float = 1.0, *, sigmoid: bool = False,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts of router logits [T, E] by score, as (weights [T, k] float32, experts [T, k]
    int64). The scores are a softmax over the experts, or each expert's own sigmoid (`sigmoid`: DeepSeek-V3);
    a chosen expert's weight is its score. `renormalize` rescales the k weights to sum to 1 (over softmax
    scores: a softmax over the chosen experts' logits alone); `scale` multiplies them (DeepSeek's
    routed_scaling_factor). `correction` [E] (DeepSeek-V3's e_score_correction_bias) is added to the scores
    that choose the experts, not to their weights. `groups` (n, m): the experts split into n equal groups, a
    token chooses only among the m best groups (DeepSeek's group-limited routing): ranked by their best
    expert's score, or with a correction by the sum of their best two (as DeepSeek-V3 does)."""
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(dim=-1)
    ranked = scores if correction is None else scores + correction.float()
    if groups is not None:
        ranked = _within_best_groups(ranked, *groups, best=1 if correction is None else 2)
    if correction is None:
        weights, chosen = ranked.topk(top_k, dim=-1)  # (the scores themselves)
    else:
        chosen = ranked.topk(top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if sigmoid else total)  # (k sigmoid scores may all be near 0)
    return weights * scale if scale != 1.0 else weights, chosen


def _within_best_groups(scores: torch.Tensor, n: int, m: int, best: int) -> torch.Tensor:
    """Scores [T, E] with every expert outside each token's m best of n equal groups set to -inf, the groups
    ranked by the sum of their `best` highest scores."""
    t, e = scores.shape
    grouped = scores.view(t, n, e // n)
    group_scores = grouped.amax(dim=-1) if best == 1 else grouped.topk(best, dim=-1).values.sum(dim=-1)  # [T, n]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(m, dim=-1).indices, True)
    return scores.masked_fill(~kept.repeat_interleave(e // n, dim=1), float("-inf"))


def mix(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
        expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j weights[t, j] * expert(chosen[t, j], x[t]) for rows x [T, D], chosen experts [T, k] and their
    weights [T, k]: the rows are grouped by expert so that each chosen expert runs once, on its own rows
    (`expert(e, rows [n, D]) -> [n, D]`), and an expert no token chose does not run. Each token's k outputs
    are summed in its own order: a row's value does not depend on the rows beside it."""
    t, k = chosen.shape
    flat = chosen.reshape(-1)  # [T * k]
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    experts, counts = flat[order].unique_consecutive(return_counts=True)
    rows = x[order // k]  # [T * k, D], each expert's rows contiguous
    outputs = torch.empty_like(rows)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        outputs[start:start + n] = expert(e, rows[start:start + n])
        start += n
    per_slot = torch.empty_like(outputs)
    per_slot[order] = outputs  # back to (token, slot) order
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), per_slot.view(t, k, -1)).squeeze(1)  # [T, D]


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights in the linears' [out, in] layout: gate_up_proj [E, 2I, D] (each
    expert's gate rows, then its up rows), down_proj [E, D, I]."""

    # What runs one expert where the backend has kernels for it (set once by `Backend.prepare`); torch's
    # F.linear on the expert's slice of the stacked weights otherwise.
    run_expert: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows [n, D]: [n, D]."""
        if self.run_expert is not None:
            return self.run_expert(e, rows)
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate).mul_(up), self.down_proj[e])


class Router(Linear):
    """The router (the checkpoints' `gate`): each token's logits [T, E] for the experts; and, `corrected`, a
    per-expert bias that `route` adds to the scores that choose the experts (DeepSeek-V3's
    `e_score_correction_bias`, which balances the experts' load)."""

    def __init__(self, hidden_size: int, num_experts: int, corrected: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if corrected else None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Router":
        # The correction stays float32 in a bf16 model (as transformers and vLLM keep it): it tells apart experts
        # whose scores differ by less than bf16 resolves near 1.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
            self.e_score_correction_bias = nn.Parameter(bias.float(), requires_grad=bias.requires_grad)
        return self


class SparseMoE(nn.Module):
    """A decoder layer's MLP as a mixture of experts: the router (`gate`), top-k routing (`route`'s `groups`,
    `scale`, `sigmoid` scores and the router's correction, as given), and optionally a shared expert every
    token runs, scaled by a sigmoid gate of its own (Qwen2-MoE) or, `shared_gate` False, added as it is
    (DeepSeek). Names follow the Qwen checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, renormalize: bool,
                 shared_intermediate_size: int = 0, *, groups: tuple[int, int] | None = None, scale: float = 1.0,
                 shared_gate: bool = True, sigmoid: bool = False, corrected: bool = False) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.groups, self.scale = top_k, renormalize, groups, scale
        self.sigmoid = sigmoid
        self.gate = Router(hidden_size, num_experts, corrected)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared = shared_intermediate_size > 0
        self.shared_gate = self.shared and shared_gate
        if self.shared:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, bias=False)
        if self.shared_gate:
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights [T, k] and the experts [T, k] (as `route` gives them) of rows x [T, D]."""
        return route(self.gate(x), self.top_k, self.renormalize, self.groups, self.scale, sigmoid=self.sigmoid,
                     correction=self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        weights, chosen = self.choose(x)  # [T, k] each
        out = mix(x, chosen, weights, self.experts.expert)
        if self.shared_gate:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared:
            out = out + self.shared_expert(x)
        return out
