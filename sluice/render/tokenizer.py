"""A checkpoint's tokenizer, chat template and end-of-sequence ids, and the prompt budget that rejects a
text too long for the context before it is tokenized in full."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from sluice.base.checkpoint import eos_token_ids, read_json
from sluice.render.errors import RequestError

# A text with more characters than this for each token of the context is first tokenized in part (see
# PromptBudget.encode). Ordinary text has 3 to 5 a token, so a prompt that fits seldom pays for the part.
PROBE_CHARS_PER_TOKEN = 8
# A space right after a non-space character: every common pre-tokenizer (GPT-2 style regexes, Metaspace,
# whitespace) ends a piece there, so the text before it tokenizes as it does within the whole text.
_PIECE_END = re.compile(r"(?<=\S) ")


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]  # bos_token / eos_token / ... as the template sees them
    vocab_size: int
    max_token_chars: int  # the most characters of text one token stands for


def context_length_error(max_model_len: int, detail: str) -> RequestError:
    return RequestError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                        f"prompt {detail}. Please reduce the length of the prompt.",
                        param="messages", code="context_length_exceeded")


@dataclass(frozen=True)
class PromptBudget:
    """The context a prompt must fit, and cheap ways to see that a text cannot, before the whole of it is
    tokenized (which takes seconds and gigabytes for tens of megabytes): no token covers more than
    `max_token_chars` characters, so a text of more than `max_chars` characters has too many tokens."""

    max_tokens: int
    max_token_chars: int

    @property
    def max_chars(self) -> int:
        return self.max_tokens * self.max_token_chars

    def check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise self.too_long(chars)

    def too_long(self, chars: int) -> RequestError:
        return context_length_error(self.max_tokens, f"is at least {chars} characters long, more than "
                                    f"{self.max_tokens} tokens of at most {self.max_token_chars} characters each hold")

    def encode(self, tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
        """The text's ids, or a context-length error as soon as it is clear they cannot fit."""
        self.check_chars(len(text))
        probe = PROBE_CHARS_PER_TOKEN * self.max_tokens
        if len(text) > probe and (head := _head(text, probe)):
            # A long text whose first part alone has too many tokens: no need to tokenize the rest.
            n = len(tokenizer.encode(head, add_special_tokens=False).ids)
            if n > self.max_tokens:
                raise context_length_error(self.max_tokens, f"has at least {n} tokens")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _head(text: str, chars: int) -> str:
    """The text up to a piece end at most `chars` in ("" if there is none near)."""
    ends = [m.start() for m in _PIECE_END.finditer(text, max(0, chars - 4096), chars)]
    return text[:ends[-1]] if ends else ""


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def chat_template(path: Path, choice: str | None = None) -> str | None:
    """The chat template: `choice` (--chat-template) as a file, or as a name in tokenizer_config.json's list of
    named templates; else the checkpoint's chat_template.jinja, its tokenizer_config.json's template (of a
    list, the one named "default"). ValueError where `choice` is neither."""
    tok_cfg = read_json(path / "tokenizer_config.json")
    listed = tok_cfg.get("chat_template")
    named = {t["name"]: t["template"] for t in listed} if isinstance(listed, list) else {}
    if choice is not None:
        if Path(choice).is_file():
            return Path(choice).read_text()
        if choice in named:
            return named[choice]
        raise ValueError(f"--chat-template {choice}: no such file, and the checkpoint names no such template"
                         + (f" (it names {', '.join(sorted(named))})" if named else ""))
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    return listed if isinstance(listed, str) else named.get("default")


def load_tokenizer(path: Path, template_choice: str | None = None) -> TokenizerBundle:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_cfg = read_json(path / "tokenizer_config.json")
    template = chat_template(path, template_choice)
    special = {k: _token_text(tok_cfg[k]) or "" for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if k in tok_cfg}
    eos = eos_token_ids(path)
    if special.get("eos_token") and (tid := tokenizer.token_to_id(special["eos_token"])) is not None:
        eos.append(tid)
    return TokenizerBundle(tokenizer, template, tuple(dict.fromkeys(eos)), special, tokenizer.get_vocab_size(),
                           max_token_chars(tokenizer))


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token covers: its decoded length, or its length in the vocabulary
    (a byte-level token: its bytes), whichever is more."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    decoded = tokenizer.decode_batch([[i] for i in vocab.values()], skip_special_tokens=False)
    return max(1, max(map(len, vocab), default=0), max(map(len, decoded), default=0))
