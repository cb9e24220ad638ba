"""The LM head on the CPU. With a small model and a big vocabulary this product is most of a decode step, and
torch's F.linear runs it well below memory bandwidth (bench/RESULTS.md#cpu-kernels). The first path that applies:

- float32 activations, AVX-512F (else AVX2 and FMA: csrc/f32_matmul_avx2.c, the same values): csrc/f32_matmul.c
  on the weight packed once (a bf16 weight kept in bf16 and widened in registers: exact), logits in float32 or
  each greedy row's argmax without writing them; greedy rows screened in int8 first (csrc/f32_int8_argmax.c,
  with AVX512-VNNI, else built for AVX2: VPMADDUBSW + VPMADDWD): the same tokens.
- bf16 weight and activations, AVX512-BF16: csrc/bf16_matmul.c, which reads the weight near the
  machine's read bandwidth at batch 1 and finds greedy rows' argmax without writing the logits; with
  AVX512-VNNI too, greedy rows are first screened on an int8 copy of the weight (csrc/int8_argmax.c): the
  same tokens, exactly, in fewer instructions.
- other weights: oneDNN with the weight reordered once into its blocked layout (faster than F.linear, the same
  values), else F.linear.
"""
from __future__ import annotations

import torch

from sluice.engine.backend import LMHead
from sluice.engine.cpu.matmul import Bf16Matmul, Bf16Screen, F32Matmul, Int8Argmax, narrowed


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, RuntimeError):  # an op this torch build lacks
        return None


class CpuLMHead(LMHead):
    def __init__(self, weight: torch.Tensor, kernel: F32Matmul | Bf16Matmul | None,
                 screen: Int8Argmax | Bf16Screen | None, onednn: torch.Tensor | None) -> None:
        super().__init__(weight)
        self.kernel, self.screen, self.onednn = kernel, screen, onednn

    @classmethod
    def build(cls, weight: torch.Tensor, dtype: torch.dtype) -> "CpuLMHead":
        """The head of `weight` for activations in `dtype` (the first path of the module's doc that runs)."""
        if dtype == torch.float32 and (kernel := F32Matmul.build(narrow := narrowed(weight))) is not None:
            return cls(weight, kernel, Bf16Screen.build(kernel, narrow) or Int8Argmax.build(kernel, narrow), None)
        if dtype == torch.bfloat16 and (bf16 := Bf16Matmul.build(weight)) is not None:
            return cls(weight, bf16, Int8Argmax.build(bf16, weight), None)
        if dtype == torch.float32 and weight.dtype != dtype:  # (a bf16 table loaded as it is stored: widened once)
            weight = weight.float()
        return cls(weight, None, None, onednn_packed(weight) if weight.dtype == dtype else None)

    @property
    def path(self) -> str:  # type: ignore[override]
        screened = f" (greedy rows screened in {self.screen.kind})" if self.screen else ""
        if isinstance(self.kernel, F32Matmul):
            weight = "bf16" if self.kernel.bf16 else "float32"
            return f"Sluice's float32 kernel ({self.kernel.isa}, the weight in {weight}){screened}"
        if self.kernel is not None:
            return "Sluice's AVX512-BF16 kernel" + screened
        return "oneDNN" if self.onednn is not None else "F.linear"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.onednn, None, "none", [], "")
        return super().__call__(hidden)

    def values(self) -> torch.Tensor:
        if self.weight.numel() or self.kernel is None:
            return self.weight
        return self.kernel.rows(torch.arange(self.kernel.n))  # (given the model's table: Backend.give_table)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token [B]: the first index of the maximum of its logits as `__call__` gives
        them (the same token, without writing the logits, on the kernels' paths)."""
        if self.screen is not None and self.screen.active:
            return self.screen(hidden)
        if self.kernel is not None:
            return self.kernel.argmax(hidden)
        return super().argmax(hidden)
