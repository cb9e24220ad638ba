"""Shared, stage-neutral reading of a checkpoint directory's metadata, and xgrammar's view of its tokenizer."""
from __future__ import annotations

import json
import threading
from pathlib import Path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(path: Path) -> list[int]:
    """EOS ids from generation_config.json, then config.json (in that order, without repeats)."""
    out: list[int] = []
    for source in (read_json(path / "generation_config.json"), read_json(path / "config.json")):
        value = source.get("eos_token_id")
        out.extend(value if isinstance(value, list) else [value] if value is not None else [])
    return list(dict.fromkeys(out))


def tokenizer_info(model_path: str, vocab_size: int):
    """xgrammar's TokenizerInfo for the checkpoint (its default stop ids; each matcher sets its own)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                              stop_token_ids=eos_token_ids(Path(model_path)) or None)


class Background:
    """A value built on a thread at startup, so the first request that needs it does not stall a stage."""

    def __init__(self, build) -> None:
        self._done = threading.Event()
        self._value = self._error = None

        def run():
            try:
                self._value = build()
            except Exception as e:  # reported to whoever asks for the value
                self._error = e
            self._done.set()

        threading.Thread(target=run, name="warm-up", daemon=True).start()

    def get(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value
