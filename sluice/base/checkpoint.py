"""Shared, stage-neutral reading of a checkpoint directory's metadata, and xgrammar's view of its tokenizer."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(path: Path) -> list[int]:
    """EOS ids from generation_config.json, then config.json (in that order, without repeats)."""
    out: list[int] = []
    for source in (read_json(path / "generation_config.json"), read_json(path / "config.json")):
        value = source.get("eos_token_id")
        out.extend(value if isinstance(value, list) else [value] if value is not None else [])
    return list(dict.fromkeys(out))


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_path: str, setting: str) -> dict[str, float]:
    """The sampling defaults `--generation-config` puts in force (as vLLM's --generation-config does): those of
    SAMPLING_DEFAULTS that generation_config.json sets, in the checkpoint (auto) or in a directory; none for
    `none`. FileNotFoundError for a directory without one."""
    if setting == "none":
        return {}
    folder = Path(model_path if setting == "auto" else setting)
    if setting != "auto" and not (folder / "generation_config.json").is_file():
        raise FileNotFoundError(f"--generation-config {setting}: no generation_config.json there")
    found = read_json(folder / "generation_config.json")
    return {k: float(found[k]) for k in SAMPLING_DEFAULTS if isinstance(found.get(k), (int, float))
            and not isinstance(found.get(k), bool)}


def tokenizer_info(model_path: str, vocab_size: int):
    """xgrammar's TokenizerInfo for the checkpoint, straight from tokenizer.json's vocabulary
    (its default stop ids only; each matcher sets its own)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = [""] * vocab_size
    for token, i in Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    kinds = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer"), spec.get("normalizer")])
    if '"ByteLevel"' in kinds:
        vocab_type, prefix_space = xgr.VocabType.BYTE_LEVEL, False
    elif '"ByteFallback"' in kinds:  # sentencepiece-style: "▁" marks a space, and a leading one is implied
        vocab_type, prefix_space = xgr.VocabType.BYTE_FALLBACK, '"Prepend"' in kinds or '"first"' in kinds
    else:
        vocab_type, prefix_space = xgr.VocabType.RAW, False
    return xgr.TokenizerInfo(vocab, vocab_type=vocab_type, vocab_size=vocab_size,
                             stop_token_ids=eos_token_ids(Path(model_path)) or None, add_prefix_space=prefix_space)


def guidance_tokenizer(model_path: str, vocab_size: int):
    """llguidance's view of the checkpoint's tokenizer, from tokenizer.json (its end tokens: the model's EOS
    ids; each request's own stop ids are added where a grammar may end)."""
    import llguidance

    path = Path(model_path)
    return llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=vocab_size,
                                  eos_token=eos_token_ids(path) or None)


class Background:
    """A value built on a thread, so building it does not stall a stage's loop.

    Built at once, or (lazy=True) on the first `start()` / `get()`."""

    def __init__(self, build, lazy: bool = False) -> None:
        self._build = build
        self._done = threading.Event()
        self._started = False
        self._value: Any = None
        self._error: Exception | None = None
        if not lazy:
            self.start()

    def start(self) -> None:
        if self._started:
            return
        self._started = True

        def run():
            try:
                self._value = self._build()
            except Exception as e:  # reported to whoever asks for the value
                self._error = e
            self._done.set()

        threading.Thread(target=run, name="warm-up", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def get(self):
        self.start()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value
