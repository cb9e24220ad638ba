"""A checkpoint's GPTQ / AWQ `quantization_config`, read without torch: the supervisor refuses what is not
served before it starts a process (sluice/app/cli.py), and engine/gptq.py reads the tensors by it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's `quantization_config`, as far as it matters here."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all of K
    v1_zeros: bool  # GPTQ v1: zero points stored minus one


def scheme(hf_config: dict) -> Scheme | None:
    """The GPTQ / AWQ scheme of an HF config; None without a `quantization_config` (or with gpt-oss's mxfp4,
    which its model reads). Raises ValueError naming the field for what is not served."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        return None
    if method not in ("gptq", "awq"):
        raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not served: Sluice "
                         "reads GPTQ and AWQ int4 checkpoints (and gpt-oss's mxfp4); use a float checkpoint "
                         "(with --quantization int8 / q4 to quantize it at load) or a GGUF file")
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
