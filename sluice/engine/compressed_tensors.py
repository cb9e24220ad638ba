"""compressed-tensors int8 checkpoints (W8A8 / W8A16: llm-compressor's `*-quantized.w8a8`), read at load into
per-channel int8 (Q8_C) or Q8_0 blocks (engine/quant.py).

A quantized linear W [N, K] is stored as `weight` int8 [N, K] and `weight_scale`: one scale for the tensor
([1]), one per output channel ([N, 1]) or one per group of input columns ([N, K / group]), symmetric (no zero
point, or an all-zero `weight_zero_point`), meaning W = weight_scale * weight (gptq_config.int8_scheme reads
the config and refuses the rest). On the CPU, a linear whose parts all have a scale per tensor or per channel
(the W8A8 recipes') is held as it is stored, Q8_C: its int8 values and a float32 scale a row, exactly. A scale
per group of a multiple of 32 columns is one scale per block of 32 repeated, so the weight is a Q8_0 weight of
the same int8 values and, where the scales are float16 values (bfloat16 and float16 ones within float16's
normal range are), exactly the same float32 values. Float32 scales that are not float16 values are rounded to
float16 (each weight off by at most 2^-11 of itself: the log says how many parts); groups that are not whole
blocks of 32, scales that float16 cannot hold that closely (under its normal range), and every layer on a
device other than the CPU, are dequantized to the model's dtype at load.

Activations: a W8A8 checkpoint quantizes each row of a linear's input to int8 at run time (`input_activations`
dynamic per token; or static, with an `input_scale`, which is read and not used). The CPU's kernels take the
rows as the backend chooses for every quantized linear (engine/cpu/quant.py): with int8 activations (the
default), a Q8_C linear's rows are quantized per group of 128 values (csrc/quant_channel.h: finer than the
checkpoint's per token, whose rounding costs more perplexity), a Q8_0 one's per block of 32; with
SLUICE_QUANT_ACTIVATIONS=float, the weight-only product (Q8_C weights run as Q8_0 blocks of the same values).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from sluice.engine.gptq import q8_0, stored_prefixes
from sluice.engine.gptq_config import Int8Scheme
from sluice.engine.quant import QuantizedWeight, channel_int8

log = logging.getLogger("sluice.engine")

_BLOCK = 32
_UNUSED = ("input_scale", "input_zero_point")  # static activations' parameters: read, not used (see above)


def _scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A weight_scale as float32 [N, G]: G groups of K / G columns (one: per tensor or per channel)."""
    s = scale.float().reshape(-1, 1) if scale.numel() in (1, n) else scale.float()
    if s.dim() != 2 or s.shape[0] not in (1, n) or k % s.shape[1]:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not scale a [{n}, {k}] weight")
    return s.expand(n, -1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values [N, K] of an int8 weight and its weight_scale (per tensor, channel or group)."""
    n, k = weight.shape
    s = _scales(scale, n, k)
    return weight.float() * s.repeat_interleave(k // s.shape[1], dim=1)


def to_blocks(weight: torch.Tensor, scale: torch.Tensor) -> tuple[QuantizedWeight, bool] | None:
    """The weight as Q8_0 blocks, and whether its values are exactly the checkpoint's; None where no block
    format holds it (see the module's doc)."""
    n, k = weight.shape
    s = _scales(scale, n, k)
    if k % _BLOCK or k // s.shape[1] % _BLOCK:
        return None  # (a block would span groups)
    s = s.repeat_interleave(k // s.shape[1] // _BLOCK, dim=1)  # [N, K / 32]
    d = s.half()
    inexact = d.float() != s
    if not bool(torch.isfinite(d).all()) or bool((inexact & (d.abs() < 2**-14)).any()):
        return None  # (beyond float16's range, or rounded below its normal numbers: more than 2^-11 off)
    return q8_0(weight, d), not bool(inexact.any())


class Reader:
    """Loads a compressed-tensors int8 checkpoint's linears (engine/loader.py calls `linear` for each
    parameter), as engine/gptq.py's Reader does GPTQ's."""

    def __init__(self, s: Int8Scheme, device: torch.device) -> None:
        self.scheme, self.device = s, device
        self.kinds: Counter[str] = Counter()
        self.expert_values = 0  # of the weights `float_weight` dequantized

    def linear(self, model: torch.nn.Module, name: str, has: Callable[[str], bool],
               fetch: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor | None, list[str]] | None:
        """For a linear's `weight` stored as int8 (alone or as the parts of a stacked projection): (None, the
        tensors used) where the layer now holds Q8_0 blocks, (the float32 values [N, K], the tensors used)
        where it is dequantized; None where `name` is not stored quantized."""
        from sluice.engine.layers import Linear
        from sluice.engine.quant import set_quantized

        if (prefixes := stored_prefixes(name, has, "weight_scale")) is None:
            return None
        module = model.get_submodule(name[: -len(".weight")])
        used: list[str] = []
        parts: list[QuantizedWeight | torch.Tensor] = []
        kinds = []
        read = [_read(prefix, has, fetch) for prefix in prefixes]
        kernel = self.device.type == "cpu" and isinstance(module, Linear)
        if kernel and all(scale.numel() in (1, weight.shape[0]) and weight.shape[1] % _BLOCK == 0
                          for weight, scale, _ in read):
            set_quantized(module, tuple(channel_int8(w, s.float().reshape(-1).expand(w.shape[0])) for w, s, _ in read))
            self.kinds["int8 per channel"] += len(read)
            return None, [n for *_, names in read for n in names]
        for weight, scale, names in read:
            used += names
            found = to_blocks(weight, scale) if kernel else None
            if found is None:
                parts.append(dequantize(weight, scale))
                continue
            parts.append(found[0])
            kinds.append("Q8_0" if found[1] else "Q8_0 (scales rounded to float16)")
        if all(isinstance(p, QuantizedWeight) for p in parts):
            set_quantized(module, tuple(parts))  # type: ignore[arg-type]
            self.kinds.update(kinds)
            return None, used
        self.kinds["dequantized"] += len(parts)
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]), used

    def float_weight(self, prefix: str, has: Callable[[str], bool],
                     fetch: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, list[str]] | None:
        """The float32 values [N, K] of an int8 linear that a model reads itself (a mixture's experts: no kernel
        runs them in a block format, so they are dequantized at load, and `summary` says how much memory that
        takes) and the tensors used; None where `prefix` is not stored quantized."""
        if not has(f"{prefix}.weight_scale"):
            return None
        weight, scale, used = _read(prefix, has, fetch)
        self.kinds["dequantized (experts)"] += 1
        self.expert_values += weight.numel()
        return dequantize(weight, scale), used

    def summary(self, dtype: torch.dtype) -> None:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.kinds.items()))
        acts = ", ".join(sorted(set(self.scheme.activations))) or "none"
        log.info("compressed-tensors int8 checkpoint (weight scales per %s; the checkpoint's activations: %s, run "
                 "as the quantized kernels take them): linear parts %s", "/".join(sorted(set(self.scheme.strategies))),
                 acts, kinds or "none")
        if self.expert_values:
            log.info("int8 experts dequantized at load (no quantized expert kernel): %d values, %.1f MiB in %s",
                     self.expert_values, self.expert_values * dtype.itemsize / 2**20, dtype)


def _read(prefix: str, has: Callable[[str], bool],
          fetch: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A quantized linear's int8 weight [N, K], its weight_scale and the tensors used (an all-zero zero point
    and a static input scale among them)."""
    weight, scale = fetch(f"{prefix}.weight"), fetch(f"{prefix}.weight_scale")
    used = [f"{prefix}.weight", f"{prefix}.weight_scale"]
    if weight.dtype != torch.int8:
        raise ValueError(f"{prefix}.weight: {weight.dtype}, not the int8 of a compressed checkpoint")
    if has(zero := f"{prefix}.weight_zero_point"):
        if bool(fetch(zero).any()):
            raise ValueError(f"{zero}: an asymmetric weight (zero points) is not served")
        used.append(zero)
    return weight, scale, used + [f"{prefix}.{sfx}" for sfx in _UNUSED if has(f"{prefix}.{sfx}")]
