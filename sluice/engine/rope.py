"""Rotary position embeddings with the Hugging Face scaling types."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sluice.engine.attention import AttentionMetadata


def rope_params(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from either the classic or the transformers-5 config keys; the dict also holds
    `partial_rotary_factor` (the share of each head rotated) and the original context length where the
    config gives them beside it."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    params.setdefault("rope_type", params.get("type", "default"))
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if params["rope_type"] in ("longrope", "su"):  # (Phi-3 keeps its original length beside the factors)
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return theta, params


def inv_freq_and_scale(dim: int, theta: float, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scaling applied to cos/sin."""
    kind = params["rope_type"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "none":  # no rotation: cos 1, sin 0 (a layer without RoPE, SmolLM3)
        return torch.zeros_like(inv_freq), 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, params), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, factor, params, max_positions)
    raise ValueError(f"rope scaling type {kind!r} is not supported "
                     "(supported: default, linear, llama3, yarn, longrope)")


def _longrope_scale(p: dict, max_positions: int) -> float:
    factor = float(p.get("factor") or max_positions / p["original_max_position_embeddings"])
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    return math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"])) if factor > 1 else 1.0


def rope_tables(dim: int, max_positions: int, theta: float, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, dim/2] (float32) of every position. LongRoPE (Phi-3): [2 * max_positions,
    dim/2], the short factors' rows, then the long factors' (`Rotary.rows` chooses between them per
    sequence)."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    if params["rope_type"] in ("longrope", "su"):
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        factors = torch.tensor([params["short_factor"], params["long_factor"]], dtype=torch.float64)  # [2, dim/2]
        freqs = torch.cat([torch.outer(positions, 1.0 / (f * base)) for f in factors])
        scale = _longrope_scale(params, max_positions)
    else:
        inv_freq, scale = inv_freq_and_scale(dim, theta, params, max_positions)
        freqs = torch.outer(positions, inv_freq)
    return (freqs.cos() * scale).float(), (freqs.sin() * scale).float()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (DeepSeek's `mscale` weights the log)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _llama3(inv_freq: torch.Tensor, factor: float, p: dict) -> torch.Tensor:
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, factor: float, p: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    original = float(p.get("original_max_position_embeddings") or max_positions)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    scale = p.get("attention_factor")
    if scale is None and p.get("mscale") and p.get("mscale_all_dim"):  # (DeepSeek: the ratio, often 1)
        scale = yarn_mscale(factor, float(p["mscale"])) / yarn_mscale(factor, float(p["mscale_all_dim"]))
    elif scale is None:
        scale = yarn_mscale(factor)
    return inv_freq, float(scale)


class Rotary(torch.nn.Module):
    """Neox-style (rotate-half) rotary embedding over a precomputed cos/sin table. Optionally on the first
    dimensions of each head only (the params' `partial_rotary_factor`: Phi-4-mini, GLM-4), and pairing dimensions
    2i and 2i + 1 instead of i and i + dim/2 (`interleaved`: GLM-4, DeepSeek-V2).

    LongRoPE (Phi-3) rotates a sequence by its short factors while it is at most the original context length,
    and by its long factors once a step makes it longer: every token a step computes for a sequence whose
    last position in that step is past `original_max_position_embeddings`, as transformers does per forward
    (keys already in the cache stay as they were rotated). The table holds both (`rows` picks a row per
    token). Unlike transformers' generation, a prompt chunked across that length takes the short factors for
    its chunks below it: the model sees a step's positions, not the length its prompt will reach."""

    def __init__(self, dim: int, max_positions: int, theta: float, params: dict, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = int(dim * params.get("partial_rotary_factor", 1.0))
        self.interleaved = interleaved
        # what the backends' kernels compute: every dimension, rotate-half
        self.plain = self.rotary_dim == dim and not interleaved
        self._args = (self.rotary_dim, max_positions, theta, params)
        self.switch_at = int(params["original_max_position_embeddings"]) \
            if params["rope_type"] in ("longrope", "su") else None  # (None: one row per position)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [P, rotary_dim/2]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Computes the tables on the ambient device (again, after a build on meta)."""
        dim, max_positions, theta, params = self._args
        self._last: tuple = (None, None, None, None)
        if torch.empty(0).device.type == "meta":  # shapes only (arange on meta costs torch's whole compiler import)
            rows = max_positions * (1 if self.switch_at is None else 2)
            self.cos = self.sin = torch.empty(rows, dim // 2)
            return
        self.cos, self.sin = rope_tables(dim, max_positions, theta, params)

    def rows(self, positions: torch.Tensor, meta: "AttentionMetadata") -> torch.Tensor:
        """The table row [T] of each of a step's tokens at `positions` [T]: the position itself, except under
        LongRoPE for the tokens of a sequence the step takes past the original length (their long factors'
        rows, after the short ones'). Each group's `out_index` rows are its sequences' tokens."""
        if self.switch_at is None:
            return positions
        t = positions.shape[0]
        padded = torch.cat([positions, positions.new_full((1,), -1)])  # the pads' row T: never the last
        long = torch.zeros(t + 1, dtype=torch.bool, device=positions.device)
        for g in meta.groups:
            ends = padded[g.out_index].amax(dim=1, keepdim=True)  # [B, 1] each sequence's last position
            long[g.out_index] = (ends >= self.switch_at).expand_as(g.out_index)
        return positions + long[:t] * self.max_positions

    def _at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` [T, 1, D/2]; every layer of a step asks with the same tensor, and
        looks them up once."""
        last_positions, last_dtype, cos, sin = self._last
        if last_positions is not positions or last_dtype != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._last = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D], positions: [T]
        cos, sin = self._at(positions, x.dtype)  # [T, 1, R/2]
        if self.plain:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rot, rest), dim=-1)
