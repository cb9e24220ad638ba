"""A checkpoint's GPTQ / AWQ / compressed-tensors `quantization_config`, read without torch: the supervisor
refuses what is not served before it starts a process (sluice/app/cli.py), and engine/gptq.py (or
engine/compressed_tensors.py) reads the tensors by it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's `quantization_config`, as far as it matters here."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all of K
    v1_zeros: bool  # GPTQ v1: zero points stored minus one


@dataclass(frozen=True)
class Int8Scheme:
    """A compressed-tensors checkpoint of int8 weights (W8A8 / W8A16: `format` int-quantized or
    naive-quantized), symmetric, one scale per tensor, output channel or group of input columns."""

    strategies: tuple[str, ...]  # each config group's weight strategy (tensor, channel, group)
    activations: tuple[str, ...]  # each group's input activations as the checkpoint quantizes them ("" for none)


_CT_FORMATS = ("int-quantized", "naive-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group")


def scheme(hf_config: dict) -> Scheme | Int8Scheme | None:
    """The GPTQ / AWQ / compressed-tensors int8 scheme of an HF config; None without a `quantization_config`
    (or with gpt-oss's mxfp4, which its model reads). Raises ValueError naming the field for what is not
    served."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        return None
    if method == "compressed-tensors":
        return int8_scheme(qc)
    if method not in ("gptq", "awq"):
        raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not served: Sluice "
                         "reads GPTQ and AWQ int4 checkpoints, compressed-tensors int8 (W8A8) ones (and gpt-oss's "
                         "mxfp4); use a float checkpoint (with --quantization int8 / q4 to quantize it at load) or "
                         "a GGUF file")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits = {bits!r}: only 4-bit {method.upper()} checkpoints are served")
    group_size = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"quantization_config.group_size = {group_size}: not a group size")
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"quantization_config.version {qc.get('version')!r}: only AWQ's GEMM packing is served")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point false: only AWQ checkpoints with zero points are served")
        return Scheme("awq", group_size, False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: only GPTQ's own packing (gptq, "
                         "gptq_v2) is served")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic: per-module GPTQ overrides are not served")
    return Scheme("gptq", group_size, fmt == "gptq")


def int8_scheme(qc: dict) -> Int8Scheme:
    """A compressed-tensors `quantization_config` (compressed-tensors' QuantizationConfig as its
    ModelCompressor writes it) of symmetric int8 weights; ValueError naming the field for anything else."""
    def refuse(field: str, value, why: str) -> ValueError:
        return ValueError(f"quantization_config.{field} = {value!r}: {why} (Sluice reads compressed-tensors "
                          "checkpoints of symmetric int8 weights, format int-quantized: W8A8 / W8A16)")

    for field in ("kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise refuse(field, "...", "not served")
    if (sparsity := qc.get("sparsity_config")) and sparsity.get("format", "dense") != "dense":
        raise refuse("sparsity_config.format", sparsity.get("format"), "sparse weights are not served")
    if str(qc.get("quantization_status", "compressed")) != "compressed":
        raise refuse("quantization_status", qc.get("quantization_status"), "only compressed checkpoints are read")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("config_groups", groups, "no quantized layers")
    strategies, activations = [], []
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise refuse("format", fmt, "int4 (pack-quantized), fp8 (float-quantized), nvfp4 ... are not served")
        w = group.get("weights") or {}
        for key, want in (("num_bits", 8), ("type", "int"), ("symmetric", True)):
            if w.get(key) != want:
                raise refuse(f"config_groups.{name}.weights.{key}", w.get(key), f"only {want!r} is served")
        if (strategy := w.get("strategy")) not in _CT_STRATEGIES:
            raise refuse(f"config_groups.{name}.weights.strategy", strategy,
                         f"only {', '.join(_CT_STRATEGIES)} scales are served")
        if group.get("output_activations"):
            raise refuse(f"config_groups.{name}.output_activations", "...", "output quantization is not served")
        a = group.get("input_activations") or {}
        activations.append(f"{a.get('type', '')}{a.get('num_bits', '')} {a.get('strategy', '')}"
                           f"{' dynamic' if a.get('dynamic') else ''}".strip() if a else "")
        strategies.append(strategy)
    return Int8Scheme(tuple(strategies), tuple(activations))
