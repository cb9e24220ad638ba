"""Where a model's ops run: the one seam between the model files and the machine's kernels.

The model files (engine/models/) are built from engine/layers.py, whose modules ask their `backend` for
each op that has a faster form somewhere: linears, RMSNorm, rotary with the KV store, paged attention, the
whole step's layers in one call, and the LM head. `Backend` is torch's own path, for any device and dtype,
and the reference the others are tested against. engine/cpu/ is the CPU's: Sluice's C kernels, chosen at run
time for the instructions this CPU has, torch's path for what they do not cover. A new backend is a folder
like it: a subclass that overrides what it runs faster.

A backend readies a model once, after its weights are loaded and its KV cache allocated (`prepare`): it
packs the weights for its kernels then, never per step. A weight changed in place after that needs
`prepare` again.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine import attention
from sluice.engine.attention import AttentionMetadata
from sluice.engine.quant import QuantizedWeight
from sluice.engine.rope import Rotary
from sluice.engine.sampler import ExpKernels, argmax

log = logging.getLogger("sluice.engine")


class LMHead:
    """The LM head of one weight [V, D]: logits [B, V] (in the weight's dtype) of normed hidden rows [B, D],
    and each row's argmax (the first index of the maximum of those logits)."""

    kernel: Any = None  # what runs it, where a backend's kernel does (its argmax then writes no logits)
    path = "F.linear"  # (for the log)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # (a table kept narrower than the rows, as a bf16 checkpoint's is under float32 on the CPU: widened)
        return F.linear(hidden, self.weight if self.weight.dtype == hidden.dtype else self.weight.to(hidden.dtype))

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token [B] (int64)."""
        return argmax(self(hidden))

    def values(self) -> torch.Tensor:
        """Its weight [V, D] (a copy where the head holds it only packed for a kernel)."""
        return self.weight


class Backend:
    """Torch's path: every op as torch runs it, on any device and dtype (see the module's doc)."""

    name = "torch"

    def prepare(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Readies the model's modules for this backend, once, after load: each module that asks a backend
        (a `backend` attribute) gets this one, each linear what runs it (`Linear.run`). Returns whether a
        step's layers run in one call (which reads `AttentionMetadata.row_group`)."""
        for module in model.modules():
            if hasattr(module, "backend"):
                module.backend = self
            if hasattr(module, "run"):
                module.run = self.linear(module)
            if hasattr(module, "run_expert"):
                module.run_expert = self.experts(module)
        return False

    def linear(self, layer: nn.Linear):
        """What runs this linear on rows x (x -> x @ W^T + b), or None for F.linear."""
        return None

    def experts(self, experts: nn.Module):
        """What runs expert e of a mixture's stacked SwiGLU experts (engine/moe.py's `Experts`) on its rows
        [n, D] ((e, rows) -> [n, D]), or None for torch's path."""
        return None

    def lm_head(self, weight: torch.Tensor | QuantizedWeight) -> LMHead:
        """The LM head of a table [V, D] (a quantized one dequantized here: a backend with a kernel for it
        multiplies by it as it lies)."""
        return LMHead(weight.dequantize() if isinstance(weight, QuantizedWeight) else weight)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """A quantized weight's float32 values [N, K] (the rows an embedding looks up)."""
        return weight.dequantize()

    def give_table(self, model: nn.Module, head: LMHead) -> None:
        """The model's LM head table once `head` is built from it: where the head holds it in a copy of its own
        (packed for a kernel), the model's copy may go (a tied embedding then looks its rows up in the head's;
        the model's `given_head` is then that head, for another runner over the same model). A model prepared
        so holds its weights as that backend packed them: it serves that backend only."""

    def exp_kernels(self) -> ExpKernels | None:
        """The sampler's exp pass, where this backend has kernels for it (None: torch's softmax)."""
        return None

    def swiglu(self, gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a stacked gate-and-up linear (gate outputs first) on rows x [T, D]: [T, I]."""
        gate, up = gate_up(x).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == weight.dtype:
            # torch's CPU kernel computes half-precision rows in float32: the same bits as below, three
            # conversions fewer
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)

    def rope_and_store(self, qk: torch.Tensor, v: torch.Tensor, heads: int, rotary: Rotary, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rotary on a step's queries and keys qk [T, H + Hkv, D] (queries first), the rotated keys and the
        values v [T, Hkv, D] written into the paged cache at `slots` [T]; returns the rotated queries
        [T, H, D]."""
        return attention.rope_and_store(qk, v, heads, rotary, positions, k_cache, v_cache, slots)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                         slots: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                         out: torch.Tensor) -> bool:
        """One query row per sequence over its keys where they lie in the cache, into out's rows; False
        (nothing written) where this backend has no such kernel: `attention.paged_attention` then gathers."""
        return False

    def causal_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_index: torch.Tensor,
                         kv_slots: torch.Tensor, out_index: torch.Tensor, scale: float, starts: torch.Tensor | None,
                         out: torch.Tensor) -> bool:
        """Prompts' and prompt chunks' attention where they lie: sequence b's query i, row q_index[b, i] of q
        [T, H, D] at position starts[b] + i (None: i), over its keys 0..that, key j in cache slot kv_slots[b, j],
        into row out_index[b, i] of out; False (nothing written) where this backend has no such kernel (torch's
        SDPA then runs it on gathered copies)."""
        return False

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, window: int | None, sinks: torch.Tensor | None,
                        softcap: float | None = None) -> torch.Tensor:
        return attention.paged_attention(q, k_cache, v_cache, meta, scale, window, sinks, self.decode_attention,
                                         self.causal_attention, softcap)


TORCH = Backend()


def select_backend(device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend for a model on `device` with activations in `dtype`."""
    if device.type == "cpu":
        from sluice.engine.cpu.backend import CpuBackend

        return CpuBackend(dtype)
    return TORCH
