"""A single GGUF file served as a checkpoint: its metadata written once as the files of a Hugging Face
checkpoint directory (config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja), beside a pointer to the file, so every stage reads a GGUF model as it reads any
other; only the engine's loader opens the file itself (engine/gguf.py), for its weights.

Families: the Llama family (llama.cpp's `llama`) and Qwen2 / Qwen3, with the GPT-2 style byte-level BPE
tokenizer they use (`tokenizer.ggml.model` = gpt2).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from sluice.base import envs

SOURCE = "gguf_source.json"  # in the metadata directory: {"file": the GGUF file's absolute path}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_VERSION = 1  # of what is written here: a change makes every file's directory anew

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex of the Hugging Face tokenizer
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def is_gguf_checkpoint(path: Path) -> bool:
    return (path / SOURCE).is_file()


def gguf_file(path: Path) -> Path:
    """The GGUF file a metadata directory stands for."""
    return Path(json.loads((path / SOURCE).read_text())["file"])


def gguf_checkpoint(file: Path, root: Path | None = None) -> Path:
    """The metadata directory of a GGUF file (written on first use, under the cache directory, keyed by the
    file's path, size and modification time)."""
    file = file.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{_VERSION} {file} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = root or envs.cache_dir() / "gguf"
    target = root / f"{file.stem}-{key}"
    if is_gguf_checkpoint(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{file.stem}-", dir=root))
    try:
        write_metadata(file, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not is_gguf_checkpoint(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def metadata(file: Path) -> tuple[dict, set[str]]:
    """The file's key-value metadata (plain Python values) and its tensors' names."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name for t in reader.tensors}


def write_metadata(file: Path, out: Path) -> None:
    meta, tensors = metadata(file)
    config = hf_config(meta, tensors)
    tokenizer = build_tokenizer(meta)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    special = {name: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
               for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                                 ("unk_token", "unknown")) if f"tokenizer.ggml.{key}_token_id" in meta}
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special},
                                                          indent=2))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(dict.fromkeys(eos))}, indent=2))
    if template := meta.get("tokenizer.chat_template"):
        (out / "chat_template.jinja").write_text(template)
    (out / SOURCE).write_text(json.dumps({"file": str(file)}))


def hf_config(meta: dict, tensors: set[str]) -> dict:
    """config.json of the file's model (ValueError for a family or a feature not served)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF files with per-frequency rope factors (rope_freqs, Llama 3.1+) are not supported yet")

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": get("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", 1.0)}
        if original := get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def build_tokenizer(meta: dict):
    """The `tokenizers` Tokenizer of the file's GPT-2 style byte-level BPE vocabulary, merges and special
    tokens (control and user-defined tokens as added tokens, so they are matched whole)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (only gpt2-style byte-level BPE)")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    pre = meta.get("tokenizer.ggml.pre", "")
    if (split := SPLITS.get(pre)) is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # GPT-2's split, each digit alone
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # (gpt2, default)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_tokens([AddedToken(tokens[i], special=t == _TOKEN_CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok
