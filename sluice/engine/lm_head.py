"""The LM head: logits [B, V] from the normed hidden rows [B, D], or each row's argmax without the logits
(greedy decoding), on the backend of the weight's device (engine/backend.py; the CPU's: engine/cpu/lm_head.py)."""
from __future__ import annotations

import torch

from sluice.engine.backend import LMHead, select_backend

__all__ = ["LMHead", "lm_head"]


def lm_head(weight: torch.Tensor, dtype: torch.dtype | None = None) -> LMHead:
    """The LM head of `weight` [V, D] for hidden rows in `dtype` (the weight's by default)."""
    return select_backend(weight.device, dtype or weight.dtype).lm_head(weight)
