"""A single GGUF file served as a checkpoint: its metadata written once as the files of a Hugging Face
checkpoint directory (config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja), beside a pointer to the file, so every stage reads a GGUF model as it reads any
other; only the engine's loader opens the file itself (engine/gguf.py), for its weights.

Families: the Llama family (llama.cpp's `llama`) and Qwen2 / Qwen3, with a GPT-2 style byte-level BPE
tokenizer (`tokenizer.ggml.model` = gpt2: Llama 3, Qwen) or a SentencePiece one (`llama`: Llama 2, Mistral,
built as a BPE with byte fallback whose merges come from the pieces' scores, as transformers' GGUF reader does).

Llama 3.1+ files carry their rope scaling only as a tensor, `rope_freqs.weight` (one factor per rotary
frequency, by which llama.cpp divides it; its converter writes no rope.scaling.* keys for them): the factors are
mapped back to the `llama3` rope_scaling that gives them (factor, low/high_freq_factor,
original_max_position_embeddings), checked to reproduce every factor.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from sluice.base import envs

SOURCE = "gguf_source.json"  # in the metadata directory: {"file": the GGUF file's absolute path}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_VERSION = 2  # of what is written here: a change makes every file's directory anew

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex of the Hugging Face tokenizer
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values
ROPE_FREQS = "rope_freqs.weight"


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


def metadata(file: Path) -> tuple[dict, dict[str, list[float] | None]]:
    """The file's key-value metadata (plain Python values) and its tensors' names (each None, except the rope
    factors' values)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    tensors = {t.name: [float(x) for x in t.data] if t.name == ROPE_FREQS else None for t in reader.tensors}
    return {k: f.contents() for k, f in reader.fields.items()}, tensors


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


def hf_config(meta: dict, tensors: dict[str, list[float] | None]) -> dict:
    """config.json of the file's model (ValueError for a family or a feature not served)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")

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
    if (factors := tensors.get(ROPE_FREQS)) is not None:
        if "rope_scaling" in config:
            raise ValueError(f"GGUF file has both rope_freqs and rope.scaling.type {scaling!r}")
        dim = get("rope.dimension_count", config["head_dim"])
        if dim != config["head_dim"] or len(factors) != dim // 2:
            raise ValueError(f"GGUF rope_freqs has {len(factors)} factors for a rotary dimension of {dim}")
        if (llama3 := llama3_scaling(factors, config["rope_theta"], dim)) is not None:
            config["rope_scaling"] = llama3
    return config


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: float) -> list[float]:
    """The factor llama.cpp divides each rotary frequency by under Llama 3's rope scaling (what its converter
    writes as rope_freqs): 1 for wavelengths under original / high, `factor` over original / low, between
    them 1 / ((1 - s) / factor + s), s falling linearly in the frequency from 1 to 0 (transformers' llama3)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_scaling(factors: list[float], theta: float, dim: int) -> dict | None:
    """The `llama3` rope_scaling whose factors (llama3_factors) are these (None where all are 1).

    Only the two wavelengths where the ramp starts and ends (original / high, original / low) shape the
    factors, so two ramp points fix them, and the original length is a free choice: it is taken where
    low_freq_factor is 1, as in every Llama 3.x config. Fewer than two ramp points: Llama 3.1's 1 / 4 with the
    original length placed in the gap. ValueError where no such scaling gives the factors."""
    factor = max(factors)
    if factor <= 1.0 + 1e-6:
        return None
    wavelens = [2 * math.pi * theta ** (i / dim) for i in range(0, dim, 2)]
    ramp = [(1 / w, (1 / f - 1 / factor) / (1 - 1 / factor)) for f, w in zip(factors, wavelens)
            if 1.0 + 1e-4 < f < factor * (1 - 1e-4)]
    if len(ramp) >= 2:  # s = a / wavelen - b: a = original / (high - low), b = low / (high - low)
        n = len(ramp)
        mx, my = sum(x for x, _ in ramp) / n, sum(y for _, y in ramp) / n
        a = sum((x - mx) * (y - my) for x, y in ramp) / sum((x - mx) ** 2 for x, _ in ramp)
        b = a * mx - my
        if a <= 0 or b <= 0:
            raise ValueError("GGUF rope_freqs are not Llama 3 rope scaling factors")
        original, low, high = a / b, 1.0, (b + 1) / b
    else:
        low, high = 1.0, 4.0
        scaled = [w for f, w in zip(factors, wavelens) if f > 1.0 + 1e-4]
        # one ramp point: s = (original / wavelen - 1) / 3; none: the shortest scaled wavelength
        original = (3 * ramp[0][1] + 1) / ramp[0][0] if ramp else min(scaled)
    if abs(original - round(original)) < 1e-3 * original:
        original = round(original)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": round(high, 6),
               "original_max_position_embeddings": original}
    again = llama3_factors(theta, dim, factor, low, scaling["high_freq_factor"], original)
    if any(abs(x - y) > 1e-4 * y for x, y in zip(again, factors)):
        raise ValueError("GGUF rope_freqs are not Llama 3 rope scaling factors (no low/high_freq_factor and "
                         "original length give them)")
    return scaling


def build_tokenizer(meta: dict):
    """The `tokenizers` Tokenizer of the file's vocabulary: GPT-2 style byte-level BPE (its merges and special
    tokens) or SentencePiece (`llama`); control and user-defined tokens as added tokens, so they are matched
    whole."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level(meta)
    elif kind == "llama":
        tok = _sentencepiece(meta)
    else:
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (gpt2-style byte-level BPE and llama-style "
                         "SentencePiece are)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    # (SentencePiece: the text after a user-defined piece opens with "▁" as after a control token, as in
    # llama.cpp; SentencePiece itself matches user-defined pieces inside the text, with no "▁" after them)
    tok.add_tokens([AddedToken(tokens[i], special=t == _TOKEN_CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    # (llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise)
    add_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = eos is not None and meta.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        first = [tokens[bos]] if add_bos else []
        last = [tokens[eos]] if add_eos else []
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A", *last]), pair=" ".join([*first, "$A", *last, *first, "$B", *last]),
            special_tokens=[(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_level(meta: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "")
    # (Llama 3's tokenizer takes a piece the vocabulary has whole before merging, as llama.cpp does for it)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               ignore_merges=pre in ("llama-bpe", "llama3")))
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
    return tok


def _sentencepiece(meta: dict):
    """A SentencePiece BPE vocabulary (pieces with "▁" for a space, <0xNN> byte pieces) as a BPE with byte
    fallback. The file has no merges: each normal piece is the merge of every split of it into two pieces of the
    vocabulary, ranked by the piece's score (SentencePiece merges the best-scored pair first), as transformers'
    GGUF reader derives them. Spaces become "▁" and a "▁" opens the text (tokenizer.ggml.add_space_prefix,
    default on) and each stretch of text after an added token, as SentencePiece encodes each stretch and as
    llama.cpp does (Llama 2's and Mistral's own tokenizer.json normalize the same way); runs of spaces are
    squeezed and the ends' dropped where tokenizer.ggml.remove_extra_whitespaces says so."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    types = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _TOKEN_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk], fuse_unk=True,
                               byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    squeeze = [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")] \
        if meta.get("tokenizer.ggml.remove_extra_whitespaces", False) else []  # (SentencePiece's: spaces only)
    tok.normalizer = normalizers.Sequence([*squeeze, *([normalizers.Prepend("▁")] if prefix else []),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return tok
