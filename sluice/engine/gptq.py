"""Hugging Face's int4 checkpoints, GPTQ and AWQ, read at load into the block formats of engine/quant.py.

Both store a linear W [N, K] as 4-bit integers q, one zero point z and one float16 scale s per group of
`group_size` input columns (per output row), and mean W[n, k] = s[g(k), n] * (q[n, k] - z[g(k), n]):

- GPTQ (`quant_method` "gptq"): `qweight` int32 [K / 8, N], input column k in bits 4 (k % 8) .. of word
  k // 8 (lowest bits first); `qzeros` int32 [G, N / 8], column n in bits 4 (n % 8) of word n // 8; `scales`
  [G, N]; `g_idx` [K] the group of each input column (k // group_size unless the checkpoint was quantized
  in act order, `desc_act`). The zero points of GPTQ "v1" checkpoints (`checkpoint_format` "gptq", the
  default) are stored minus one (AutoGPTQ's historical off-by-one; a symmetric checkpoint stores 7 for 8);
  "gptq_v2" stores them as they are.
- AWQ (`quant_method` "awq", `version` "gemm"): `qweight` int32 [K, N / 8] and `qzeros` [G, N / 8], packed
  along the outputs in AWQ's interleaved order: the 8 fields of a word, lowest bits first, hold columns
  0, 2, 4, 6, 1, 3, 5, 7 of its 8 (so column c lies in field `_AWQ_FIELD[c]`); `scales` [G, N]; no g_idx.

Where every block of 32 input columns lies in one group and the scales are float16 values (the usual case),
the weight is converted exactly (the same float32 values): with every zero point 8 (symmetric GPTQ) to Q4_0
(d = s, the nibble q: d * (q - 8)), else to Q5_0 (d = s, the five bits q - z + 16: d * (v - 16), q - z within
[-16, 15]; 5.5 bits a weight, where Q4_1's float16 min could hold -s z only rounded), and runs on the CPU's
quantized kernels (engine/cpu/quant.py). An act-order weight's columns are sorted by group first (each group
then whole blocks) and x is read in that order (`sorted_blocks`; a stacked projection's parts, which GPTQ
orders by the same input's Hessian, must share it). Otherwise (groups not whole blocks of 32, a stacked
projection's parts in different orders, other scale types, a device other than the CPU) it is dequantized to
the model's dtype at load.

A mixture's experts (read by their model: engine/models/mixtures.py) have no quantized kernel: the loader hands
it each packed expert weight dequantized (`Reader.float_weight`), in the model's dtype, and the log says how
much memory that takes.

Refused at start, naming the field: other `quant_method`s (bitsandbytes, fp8, ...; compressed-tensors int8
is engine/compressed_tensors.py's),
`bits` other than 4, AWQ's other packings (`version` gemv...) and `zero_point` false, other GPTQ
`checkpoint_format`s (marlin...), GPTQModel's per-module `dynamic` overrides. (gpt-oss's "mxfp4" is read by
its model.)
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.gptq_config import Scheme
from sluice.engine.quant import BY_NAME, QuantizedWeight, one_order

log = logging.getLogger("sluice.engine")

_AWQ_FIELD = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ: the field (of 8 in a word) holding column c of its 8
_BLOCK = 32  # Q4_0 / Q8_0 columns a block
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def _fields(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8 W]: each word's 8 4-bit fields, lowest bits first (through the words'
    little-endian bytes: byte b holds fields 2b, low nibble, and 2b + 1)."""
    b = words.to(torch.int32).contiguous().numpy().astype("<i4", copy=False).view(np.uint8)  # [..., 4 W]
    out = np.empty((*b.shape, 2), dtype=np.uint8)
    np.bitwise_and(b, 0xF, out=out[..., 0])
    np.right_shift(b, 4, out=out[..., 1])
    return torch.from_numpy(out.reshape(*b.shape[:-1], -1))


@dataclass(frozen=True)
class Int4:
    """A linear's integers, unpacked: W[n, k] = scales[n, groups[k]] * (q[n, k] - zeros[n, groups[k]])."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    zeros: torch.Tensor  # int16 [N, G]
    scales: torch.Tensor  # [N, G], as stored (float16 mostly)
    groups: torch.Tensor  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """The float32 values [N, K] (exact: a float16 scale times an integer within [-16, 15])."""
        g = self.groups
        return self.scales.float()[:, g] * (self.q.to(torch.int16) - self.zeros[:, g]).float()


def unpack(s: Scheme, tensors: dict[str, torch.Tensor]) -> Int4:
    """One linear's packed tensors (by suffix: qweight, qzeros, scales, g_idx) unpacked."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if s.method == "gptq":
        q = _fields(qweight.t())  # [N, K]
        zeros = _fields(qzeros).to(torch.int16)  # [G, N]
        if s.v1_zeros:
            zeros = zeros + 1
    else:
        def columns(words: torch.Tensor) -> torch.Tensor:  # [R, N / 8] -> [R, N], columns in order
            fields = _fields(words)
            return fields.view(fields.shape[0], -1, 8)[:, :, list(_AWQ_FIELD)].reshape(fields.shape[0], -1)

        q = columns(qweight).t().contiguous()
        zeros = columns(qzeros).to(torch.int16)
    n, k = q.shape
    if scales.shape[1] != n or zeros.shape != scales.shape:
        raise ValueError(f"{s.method}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not describe one [{n}, {k}] weight")
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        groups = g_idx.long()
    else:
        size = k if s.group_size == -1 else s.group_size
        groups = torch.arange(k) // size
    if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= scales.shape[0]:
        raise ValueError(f"{s.method}: the groups of a [{n}, {k}] weight do not index its {scales.shape[0]} scales")
    return Int4(q, zeros.t().contiguous(), scales.t().contiguous(), groups)


def to_blocks(w: Int4) -> QuantizedWeight | None:
    """The same values in Q4_0 (every zero point 8) or Q5_0 blocks, or None where no block format holds them
    exactly (a block of 32 columns across groups, scales that are not float16 values)."""
    n, k = w.q.shape
    if k % _BLOCK:
        return None
    block_groups = w.groups.view(-1, _BLOCK)
    if not bool((block_groups == block_groups[:, :1]).all()):
        return None  # act order (or groups smaller than a block)
    scales = w.scales.float()
    d = scales.half()
    if not torch.equal(d.float(), scales) or not bool(torch.isfinite(d).all()):
        return None
    d = d[:, block_groups[:, 0]].contiguous()
    if bool((w.zeros == 8).all()):
        q = w.q.view(n, k // _BLOCK, _BLOCK)
        body = q[..., : _BLOCK // 2] | (q[..., _BLOCK // 2 :] << 4)
        data = torch.cat([d.view(torch.uint8).view(n, k // _BLOCK, 2), body], dim=2).reshape(n, -1)
        return QuantizedWeight(data.contiguous(), BY_NAME["Q4_0"], (n, k))
    # (q in 0..15 and zero points in 0..16: q - z + 16 within [0, 31], Q5_0's five bits)
    return q5_0((w.q.to(torch.int16) - w.zeros[:, w.groups] + 16).to(torch.uint8), d)


def sorted_blocks(w: Int4) -> QuantizedWeight | None:
    """An act-order weight (g_idx not k / group_size) as `to_blocks` of its columns sorted by group (stable:
    a group's columns in x's order), x then read in that order (QuantizedWeight.perm: the kernels gather each
    row of x as they quantize it, as exllama and Marlin do on the GPU); None where even sorted a block of 32
    spans groups (a group not whole blocks)."""
    perm = torch.argsort(w.groups, stable=True)
    blocks = to_blocks(Int4(w.q[:, perm], w.zeros, w.scales, w.groups[perm]))
    return None if blocks is None else dataclasses.replace(blocks, perm=perm.to(torch.int32))


def q5_0(v: torch.Tensor, d: torch.Tensor) -> QuantizedWeight:
    """Q5_0 blocks of 5-bit values v [N, K] (0..31) and one float16 scale a block of 32 columns, d [N, K / 32]:
    the weight d * (v - 16), exactly (GGML's layout: d, the 32 fifth bits, then value l's low 4 bits in byte
    l % 16, the high half of the block in the high nibbles)."""
    n, k = v.shape
    blocks = v.view(n, k // _BLOCK, _BLOCK)  # (uint8 throughout: no wider copy of a large weight)
    low = (blocks[..., : _BLOCK // 2] & 0xF) | ((blocks[..., _BLOCK // 2 :] & 0xF) << 4)
    bits = (blocks >> 4).view(n, k // _BLOCK, 4, 8)  # (value l's fifth bit: bit l % 8 of byte l // 8)
    fifth = bits[..., 0].clone()
    for i in range(1, 8):
        fifth |= bits[..., i] << i
    data = torch.cat([d.contiguous().view(torch.uint8).view(n, k // _BLOCK, 2), fifth, low], dim=2)
    return QuantizedWeight(data.reshape(n, -1).contiguous(), BY_NAME["Q5_0"], (n, k))


def q8_0(q: torch.Tensor, d: torch.Tensor) -> QuantizedWeight:
    """Q8_0 blocks of int8 values q [N, K] and one float16 scale a block of 32 columns, d [N, K / 32]: the
    weight d * q, exactly."""
    n, k = q.shape
    body = q.contiguous().view(torch.uint8).view(n, k // _BLOCK, _BLOCK)
    data = torch.cat([d.contiguous().view(torch.uint8).view(n, k // _BLOCK, 2), body], dim=2).reshape(n, -1)
    return QuantizedWeight(data.contiguous(), BY_NAME["Q8_0"], (n, k))


class Reader:
    """Loads a GPTQ / AWQ checkpoint's linears (engine/loader.py calls `linear` for each parameter)."""

    def __init__(self, s: Scheme, device: torch.device) -> None:
        self.scheme, self.device = s, device
        self.kinds: Counter[str] = Counter()
        self.expert_values = 0  # of the weights `float_weight` dequantized

    def linear(self, model: torch.nn.Module, name: str, has: Callable[[str], bool],
               fetch: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor | None, list[str]] | None:
        """For a linear's `weight` stored packed (alone or as the parts of a stacked projection): (None, the
        tensors used) where the layer now holds its weight in a block format, (the float32 values [N, K],
        the tensors used) where it is dequantized; None where `name` is not stored packed."""
        from sluice.engine.layers import Linear
        from sluice.engine.quant import set_quantized

        if (prefixes := stored_prefixes(name, has, "qweight")) is None:
            return None
        module = model.get_submodule(name[: -len(".weight")])
        used: list[str] = []
        parts: list[QuantizedWeight | torch.Tensor] = []
        for prefix in prefixes:
            names = {sfx: f"{prefix}.{sfx}" for sfx in _SUFFIXES if has(f"{prefix}.{sfx}")}
            w = unpack(self.scheme, {sfx: fetch(full) for sfx, full in names.items()})
            used += names.values()
            blocks = (to_blocks(w) or sorted_blocks(w)) if self.device.type == "cpu" and isinstance(module, Linear) \
                else None
            parts.append(w.dequantize() if blocks is None else blocks)
            if getattr(module, "bias", None) is None:
                used += _zero_bias(prefix, has, fetch)
        held = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len(held) == len(parts) and one_order(held):  # (a stacked projection's parts read x in one order)
            set_quantized(module, tuple(held))
            self.kinds.update(p.qtype.name + ("" if p.perm is None else " (act order)") for p in held)
            return None, used
        self.kinds["dequantized"] += len(parts)
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]), used

    def float_weight(self, prefix: str, has: Callable[[str], bool],
                     fetch: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, list[str]] | None:
        """The float32 values [N, K] of a packed linear that a model reads itself (a mixture's experts: no
        kernel runs them in a block format, so they are dequantized at load, and `summary` says how much memory
        that takes) and the tensors used; None where `prefix` is not stored packed."""
        if not has(f"{prefix}.qweight"):
            return None
        names = {sfx: f"{prefix}.{sfx}" for sfx in _SUFFIXES if has(f"{prefix}.{sfx}")}
        values = unpack(self.scheme, {sfx: fetch(full) for sfx, full in names.items()}).dequantize()
        self.kinds["dequantized (experts)"] += 1
        self.expert_values += values.numel()
        return values, [*names.values(), *_zero_bias(prefix, has, fetch)]

    def summary(self, dtype: torch.dtype) -> None:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.kinds.items()))
        log.info("%s int4 checkpoint: linear parts %s (Q4_0: symmetric, exact; Q5_0: zero points, exact, 5.5 bits "
                 "a weight; act order: the columns sorted by group, x read in that order; dequantized: groups across "
                 "blocks of 32, or a stacked projection's parts in different orders, in the model's dtype)",
                 self.scheme.method.upper(), kinds or "none")
        if self.expert_values:
            log.info("%s int4 experts dequantized at load (no quantized expert kernel): %d values, %.1f MiB in %s "
                     "(%d times their 4 bits)", self.scheme.method.upper(), self.expert_values,
                     self.expert_values * dtype.itemsize / 2**20, dtype, dtype.itemsize * 2)


def _zero_bias(prefix: str, has: Callable[[str], bool], fetch: Callable[[str], torch.Tensor]) -> list[str]:
    """[the bias] where a linear without one has one in the checkpoint, all zeros (AutoGPTQ writes a zero bias
    for a linear without one); ValueError where it is not all zeros."""
    if not has(f"{prefix}.bias"):
        return []
    if bool(fetch(f"{prefix}.bias").any()):
        raise ValueError(f"{prefix}.bias: the checkpoint has a bias the model's linear does not take")
    return [f"{prefix}.bias"]


def stored_prefixes(name: str, has: Callable[[str], bool], marker: str) -> list[str] | None:
    """The checkpoint prefixes a linear's `name` (`...weight`) is stored under in a quantized layout whose
    tensors include `<prefix>.<marker>`: itself, or the parts of a stacked projection (q/k/v, gate/up); None
    where it is not stored so."""
    from sluice.engine.layers import stacked_parts

    if not name.endswith(".weight"):
        return None
    prefixes = [name[: -len(".weight")]]
    if not has(f"{prefixes[0]}.{marker}"):
        prefixes = [p[: -len(".weight")] for p in stacked_parts(name)]
        if not prefixes or not all(has(f"{p}.{marker}") for p in prefixes):
            return None
    return prefixes
