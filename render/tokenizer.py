"""A checkpoint's tokenizer, chat template and end-of-sequence ids."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from sluice.checkpoint import eos_token_ids, read_json


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]  # bos_token / eos_token / ... as the template sees them
    vocab_size: int


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path: Path) -> TokenizerBundle:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_cfg = read_json(path / "tokenizer_config.json")
    template = None
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif isinstance(tok_cfg.get("chat_template"), str):
        template = tok_cfg["chat_template"]
    elif isinstance(tok_cfg.get("chat_template"), list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in tok_cfg["chat_template"]}
        template = named.get("default")
    special = {k: _token_text(tok_cfg[k]) or "" for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if k in tok_cfg}
    eos = eos_token_ids(path)
    if special.get("eos_token") and (tid := tokenizer.token_to_id(special["eos_token"])) is not None:
        eos.append(tid)
    return TokenizerBundle(tokenizer, template, tuple(dict.fromkeys(eos)), special, tokenizer.get_vocab_size())
