"""Float weights written in GPTQ's int4 checkpoint layout (round to nearest, per group of input columns, in
act order where a column order is given): for tests and benchmarks of the GPTQ path (engine/gptq.py), as
gguf_writer.py is for the GGUF one."""
from __future__ import annotations

import numpy as np
import torch


def words(fields: np.ndarray) -> torch.Tensor:
    """[..., 8 W] 4-bit values -> int32 [..., W], field i of a word in bits 4i .. 4i + 3."""
    f = fields.astype(np.uint64).reshape(*fields.shape[:-1], -1, 8)
    out = np.zeros(f.shape[:-1], dtype=np.uint64)
    for i in range(8):
        out |= f[..., i] << np.uint64(4 * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32))


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor | None,
              v1: bool) -> dict[str, torch.Tensor]:
    """q [N, K], zeros / scales [N, G] as a GPTQ checkpoint stores them: qweight [K / 8, N] packed along K,
    qzeros [G, N / 8] along N (minus one in v1), scales [G, N], g_idx [K]."""
    out = {"qweight": words(q.numpy()).t().contiguous(),  # 8 consecutive k in one word
           "qzeros": words((zeros - int(v1)).t().contiguous().numpy()),
           "scales": scales.t().contiguous()}
    if groups is not None:
        out["g_idx"] = groups.to(torch.int32)
    return out


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, groups: torch.Tensor | None = None):
    """Round-to-nearest 4-bit quantization of a float weight [N, K] per group of input columns (`groups`
    [K] the group of each, k // group_size unless given): (q, zeros, float16 scales, groups)."""
    n, k = w.shape
    groups = torch.arange(k) // group_size if groups is None else groups
    count = int(groups.max()) + 1
    q = torch.zeros(n, k, dtype=torch.int16)
    zeros = torch.zeros(n, count, dtype=torch.int16)
    scales = torch.zeros(n, count, dtype=torch.float16)
    for g in range(count):
        cols = groups == g
        x = w[:, cols].float()
        if sym:
            s = (x.abs().amax(1) / 7.5).half()
            z = torch.full((n,), 8, dtype=torch.int16)
        else:
            lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half()
            z = (-lo / s.float()).round().clamp(1, 15).to(torch.int16)  # (v1 stores z - 1 in 4 bits)
        q[:, cols] = (x / s.float()[:, None] + z[:, None]).round().clamp(0, 15).to(torch.int16)
        zeros[:, g], scales[:, g] = z, s
    return q, zeros, scales, groups


def act_order_groups(order: torch.Tensor, group_size: int) -> torch.Tensor:
    """The g_idx of an act-order checkpoint whose columns were quantized in `order` [K]: column order[i] is in
    group i // group_size."""
    groups = torch.empty(order.numel(), dtype=torch.long)
    groups[order] = torch.arange(order.numel()) // group_size
    return groups
