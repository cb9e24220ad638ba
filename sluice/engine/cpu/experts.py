"""A mixture's experts on the float32 kernels (csrc/f32_matmul.c): each expert's gate-and-up and down weights
packed once, as the model's other linears are, so a step reads only the chosen experts' packed weights (bf16
where the checkpoint's values are: half the bytes) and a row's values do not depend on the rows beside it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.cpu.matmul import F32Matmul, narrowed


class F32Experts:
    """(e, rows [n, D] float32) -> expert e's SwiGLU of the rows [n, D] (see engine/moe.py's `Experts`)."""

    def __init__(self, gate_up: list[F32Matmul], down: list[F32Matmul]) -> None:
        self.gate_up, self.down = gate_up, down

    @classmethod
    def build(cls, experts: nn.Module) -> "F32Experts | None":
        """The kernels for a module's stacked `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I], or None where
        the float32 kernels do not run here. The module's weights are then kept as the kernels read them
        (bf16 where that is exact), as `CpuBackend.linear` keeps a linear's."""
        weights = experts.gate_up_proj, experts.down_proj
        if F32Matmul.build(torch.zeros(1, 2)) is None or any(w.device.type != "cpu" for w in weights):
            return None
        gate_up, down = (narrowed(w) for w in weights)  # (one check of the whole stack, not one per expert)
        gate_up_kernels = [F32Matmul.build(w) for w in gate_up]
        down_kernels = [F32Matmul.build(w) for w in down]
        if any(k is None for k in gate_up_kernels + down_kernels):
            return None
        experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
        return cls(gate_up_kernels, down_kernels)  # type: ignore[arg-type]

    def __call__(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up[e]
        if gate_up.swiglu_ok and rows.dtype == torch.float32:
            hidden = gate_up.swiglu(rows)
        else:
            gate, up = gate_up(rows).chunk(2, dim=-1)
            hidden = F.silu(gate).mul_(up)
        return self.down[e](hidden)
