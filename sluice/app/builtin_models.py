"""Built-in tiny checkpoints, written deterministically in Hugging Face layout.

`builtin:tiny-chat` is a random-weight Qwen3-style model with a real byte-level
BPE tokenizer and a ChatML template: its text is gibberish, but every code path
(tokenizer, template, weights, paged KV, sampling) is the real one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from sluice.base import envs

BUILTIN_PREFIX = "builtin:"
_VERSION = "v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the river runs to the sea.
A server answers requests; a client sends them, waits, and reads the stream.
Tokens flow from the engine to the workers that turn them back into text.
In the morning the market opens, prices move, and traders watch the numbers.
She wrote a letter to her friend about the mountains, the snow and the lakes.
Functions take arguments and return values; a tool call names the function.
What is the weather in Paris today? It is sunny, with a light wind from the west.
Please summarize the following article in three sentences for a busy reader.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14 2.71 -1 +1 = % $ # @ & * ( ) [ ] { }
JSON looks like {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}.
Code: def add(a, b): return a + b  # for i in range(10): print(i)
Unicode: café naïve résumé über straße 東京 北京 😀 👍 ✓ → ∑ π Ω
Good evening! How can I help you? Thank you very much. You are welcome.
The history of science is the story of people asking questions and testing answers.
"""


def resolve_model(model: str) -> Path:
    """A local checkpoint directory for `model` (writing a built-in one if asked)."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX):]
        if name not in BUILTINS:
            raise ValueError(f"unknown built-in model {model!r}; choose from {sorted(BUILTINS)}")
        return ensure_builtin(name)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():  # one GGUF file: its metadata as a checkpoint directory
        from sluice.base.gguf_checkpoint import gguf_checkpoint

        return gguf_checkpoint(path)
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ValueError(f"{repo_id!r} is not a local directory and huggingface_hub is not installed") from e
    return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))


def ensure_builtin(name: str, root: Path | None = None) -> Path:
    root = root or envs.cache_dir() / "builtin"
    target = root / f"{name}-{_VERSION}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        BUILTINS[name](tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_tokenizer(vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tok.add_tokens(ADDED_TOKENS)
    return tok


def write_hf_metadata(out: Path, config: dict, eos_ids: list[int], template: str, tokenizer_config: dict) -> None:
    """A checkpoint's config.json, generation_config.json (its stop ids), chat template (a file of
    sluice/data) and tokenizer_config.json (a fast tokenizer with these special tokens)."""
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2))
    (out / "chat_template.jinja").write_text((Path(__file__).parent / "data" / template).read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}, indent=2))


def write_llama_family(
    out: Path,
    *,
    architecture: str = "Qwen3ForCausalLM",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = None,
    seed: int = 0,
    num_shards: int = 2,
    tokenizer=None,
) -> Path:
    """Writes a random-weight Llama-family checkpoint (Llama, Mistral, Qwen2 or Qwen3 layout)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer()  # a given tokenizer (e.g. o200k) must have <|endoftext|>
    tok.save(str(out / "tokenizer.json"))
    vocab_size = (tok.get_vocab_size() + 63) // 64 * 64
    eos = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>") or eos
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[architecture]
    qkv_bias = architecture == "Qwen2ForCausalLM"
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "bos_token_id": eos,
        "eos_token_id": im_end,
        "torch_dtype": "float32",
    }
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
    write_hf_metadata(out, config, [im_end, eos], "chatml.jinja", {
        # only tokens the tokenizer has: transformers would append any other as a new, out-of-range id
        "eos_token": tok.id_to_token(im_end),
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": max_position_embeddings,
    })

    randn = seeded_randn(torch.Generator().manual_seed(seed))

    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab_size, hidden_size, std=0.5)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": randn(hidden_size, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": randn(hidden_size, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": randn(q_out, hidden_size, std=0.2),
            p + "self_attn.k_proj.weight": randn(kv_out, hidden_size, std=0.2),
            p + "self_attn.v_proj.weight": randn(kv_out, hidden_size, std=0.2),
            p + "self_attn.o_proj.weight": randn(hidden_size, q_out, std=1.0),
            p + "mlp.gate_proj.weight": randn(intermediate_size, hidden_size, std=0.1),
            p + "mlp.up_proj.weight": randn(intermediate_size, hidden_size, std=0.1),
            p + "mlp.down_proj.weight": randn(hidden_size, intermediate_size, std=1.0),
        })
        if qkv_bias:
            for name, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                tensors[p + f"self_attn.{name}_proj.bias"] = randn(n, std=0.1)
        if model_type == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
            tensors[p + "self_attn.k_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
    tensors["model.norm.weight"] = randn(hidden_size, std=0.1, mean=1.0)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = randn(vocab_size, hidden_size, std=0.5)
    save_sharded(out, tensors, num_shards)
    return out


def seeded_randn(gen, dtype=None):
    """randn(*shape, std, mean) drawing from one seeded generator: the same calls give the same weights."""
    import torch

    def randn(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) * std + mean
        return t if dtype is None else t.to(dtype)

    return randn


def save_sharded(out: Path, tensors: dict, num_shards: int) -> None:
    """safetensors shards with an index, as Hugging Face writes them."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_gpt_oss(out: Path) -> Path:
    from sluice.app.builtin_gpt_oss import write_gpt_oss

    return write_gpt_oss(out)


BUILTINS = {"tiny-chat": write_llama_family, "tiny-gpt-oss": _write_gpt_oss}
