"""The LM head: logits [B, V] (in the weight's dtype) from the normed hidden rows [B, D].

With a small model and a 200k vocabulary this vocabulary-sized GEMV is most of a decode step. On the
CPU, torch's F.linear runs it at about a third of memory bandwidth; oneDNN, with the weight reordered
once into its blocked layout, runs it near the bandwidth floor (bf16, batch 1 / 16: 2.0 / 3.2 ms
against 4.5 / 6.7 ms) and gives the same values. Elsewhere (CUDA, or a torch without oneDNN) it is
F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, RuntimeError):  # an op this torch build lacks
        return None


class LMHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [V, D]
        self.packed = _pack(weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(hidden, self.weight)
        return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.packed, None, "none", [], "")
