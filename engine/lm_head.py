"""The LM head: logits [B, V] (in the weight's dtype) from the normed hidden rows [B, D], or each row's
argmax without the logits (greedy decoding).

With a small model and a 200k vocabulary this vocabulary-sized product is most of a decode step. On the
CPU, torch's F.linear runs it at about a third of memory bandwidth. Three paths, the first that applies:

- bf16 weights on a CPU with AVX512-BF16: Sluice's kernel (csrc/lm_head_bf16.c), which reads the weight
  at about the machine's read bandwidth at batch 1 and, for greedy rows, finds each row's argmax without
  writing the logits (tiny o200k model, batch 16: ~2.9 ms against ~3.9 for oneDNN and the blocked argmax
  over its output; `python -m bench.step_parts --kernels`). Its packed weight replaces oneDNN's.
- other CPU weights (float32, or no AVX512-BF16): oneDNN with the weight reordered once into its
  blocked layout (2-3x F.linear here, the same values).
- elsewhere (CUDA, or a torch without oneDNN): F.linear.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.sampler import argmax

_TILE = 16  # vocabulary rows per tile of the kernel's packed weight


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, RuntimeError):  # an op this torch build lacks
        return None


class _Bf16Kernel:
    """csrc/lm_head_bf16.c with the weight packed for it: tiles of 16 vocabulary rows, each [D/2][16][2]."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor) -> None:
        v, d = weight.shape
        tiles = -(-v // _TILE)
        w = F.pad(weight.detach(), (0, 0, 0, tiles * _TILE - v))
        self.packed = w.view(tiles, _TILE, d // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.vocab, self.dim = v, d
        self.fn = lib.sluice_lm_head_bf16
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]

    @classmethod
    def build(cls, weight: torch.Tensor) -> "_Bf16Kernel | None":
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
            return None
        lib = cpu_kernels.load("lm_head_bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
        return None if lib is None else cls(lib, weight)

    def _run(self, hidden: torch.Tensor, logits: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
        hidden = hidden.to(torch.bfloat16).contiguous()
        status = self.fn(self.packed.data_ptr(), self.vocab, self.dim, hidden.data_ptr(), hidden.shape[0],
                         None if logits is None else logits.data_ptr(), self.vocab,
                         None if tokens is None else tokens.data_ptr())
        if status:
            raise MemoryError("the LM head kernel could not allocate its workspace")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], self.vocab, dtype=torch.bfloat16)
        if hidden.shape[0]:
            self._run(hidden, out, None)
        return out

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = torch.empty(hidden.shape[0], dtype=torch.int32)
        if hidden.shape[0]:
            self._run(hidden, None, tokens)
        return tokens.long()


class LMHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [V, D]
        self.kernel = _Bf16Kernel.build(weight)
        self.onednn = None if self.kernel is not None else onednn_packed(weight)

    @property
    def path(self) -> str:
        """Which of the three runs it (for the log)."""
        if self.kernel is not None:
            return "Sluice's AVX512-BF16 kernel"
        return "oneDNN" if self.onednn is not None else "F.linear"

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.logits(hidden)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.onednn, None, "none", [], "")
        return F.linear(hidden, self.weight)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token [B]: the first index of the maximum of its logits as `__call__` gives
        them (the same token, without writing the logits, on the kernel's path)."""
        if self.kernel is not None:
            return self.kernel.argmax(hidden)
        return argmax(self(hidden))
