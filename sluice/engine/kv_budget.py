"""How many KV cache blocks the engine makes: its memory budget (--kv-cache-memory, or a share of a GPU's
free memory), split between the full-attention layers' pool and the sliding-window layers' own."""
from __future__ import annotations

import torch

from sluice.base.config import ServerConfig
from sluice.engine.model_runner import kv_block_bytes, kv_pools


def num_kv_blocks(cfg: ServerConfig, model: torch.nn.Module, dtype: torch.dtype,
                  device: torch.device) -> tuple[int, int]:
    """(blocks of the main pool, blocks of the sliding-window layers' own pool, 0 if they have none)."""
    pools = kv_pools(model)
    window_layers = sum(pools[w] == "window_table" for w in model.layer_windows)
    window = next((w for w, name in pools.items() if name == "window_table"), None)
    # what the window pool can ever need: each running sequence's window plus one step's chunk
    window_need = cfg.max_num_seqs * (-(-(window - 1 + cfg.max_num_batched_tokens) // cfg.block_size) + 1) \
        if window else 0
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks, min(window_need, cfg.num_kv_blocks)
    budget = cfg.kv_cache_memory
    if not budget:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.85) if device.type == "cuda" else 1 << 30
    full = kv_block_bytes(model, cfg.block_size, dtype, model.kv_shape[0] - window_layers)
    if not window:
        return budget // full, 0
    windowed = kv_block_bytes(model, cfg.block_size, dtype, window_layers)
    window_blocks = min(window_need, budget // 2 // windowed)
    return (budget - window_blocks * windowed) // full, window_blocks
