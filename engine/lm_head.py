"""The LM head: logits [B, V] (in the weight's dtype) from the normed hidden rows [B, D], or each row's
argmax without the logits (greedy decoding).

With a small model and a 200k vocabulary this vocabulary-sized product is most of a decode step. On the
CPU, torch's F.linear runs it at about a third of memory bandwidth. Three paths, the first that applies:

- bf16 weights on a CPU with AVX512-BF16: Sluice's kernel (csrc/bf16_matmul.c), which reads the weight
  at about the machine's read bandwidth at batch 1 and, for greedy rows, finds each row's argmax without
  writing the logits (tiny o200k model, batch 16: ~2.7 ms against ~4.3 for oneDNN and the blocked argmax
  over its output; `python -m bench.step_parts --kernels`). Its packed weight replaces oneDNN's. With
  AVX512-VNNI too, greedy rows are first screened on an int8 copy of the weight (csrc/int8_argmax.c):
  the same tokens, exactly, at about twice the speed (batch 16 ~1.3 ms against ~2.4, batch 1 ~0.4
  against ~1.1).
- other CPU weights (float32, or no AVX512-BF16): oneDNN with the weight reordered once into its
  blocked layout (2-3x F.linear here, the same values).
- elsewhere (CUDA, or a torch without oneDNN): F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_kernels import Bf16Matmul, Int8Argmax
from engine.sampler import argmax


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
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
        self.kernel = Bf16Matmul.build(weight)
        self.screen = Int8Argmax.build(self.kernel, weight)
        self.onednn = None if self.kernel is not None else onednn_packed(weight)

    @property
    def path(self) -> str:
        """Which of the three runs it (for the log)."""
        if self.kernel is not None:
            return "Sluice's AVX512-BF16 kernel" + (" (greedy rows screened in int8)" if self.screen else "")
        return "oneDNN" if self.onednn is not None else "F.linear"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.onednn, None, "none", [], "")
        return F.linear(hidden, self.weight)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token [B]: the first index of the maximum of its logits as `__call__` gives
        them (the same token, without writing the logits, on the kernel's path)."""
        if self.screen is not None and self.screen.active:
            return self.screen(hidden)
        if self.kernel is not None:
            return self.kernel.argmax(hidden)
        return argmax(self(hidden))
