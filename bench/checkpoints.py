"""Checkpoints for benchmarks, written like the built-in ones (deterministic, HF layout)."""
from __future__ import annotations

from pathlib import Path

from sluice import envs


def tiny_llama_o200k() -> Path:
    """A 2-layer Llama (hidden 128) with the real o200k vocabulary: the vocabulary-sized work dominates,
    as in ../shared/MEASUREMENTS.md."""
    from sluice.builtin_models import write_llama_family
    from sluice.harmony_vocab import ensure_vocab
    from sluice.o200k_tokenizer import build_tokenizer

    path = envs.cache_dir() / "bench" / "tiny-llama-o200k"
    if not (path / "config.json").exists():
        write_llama_family(path, architecture="LlamaForCausalLM", hidden_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=512, tie_word_embeddings=False,
                           tokenizer=build_tokenizer(ensure_vocab()))
    return path
