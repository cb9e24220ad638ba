"""Chat output parsers. Each turns the model's output into pieces of a message: content, reasoning, and
tool-call deltas. Streaming a request merges the pieces into deltas as they come; a non-streaming request
merges the same pieces into one message, so both give the same message for the same tokens.

Text parsers work on detokenized text and hold back text that could be the start of a tag, so any chunking
gives the same result.
"""
from __future__ import annotations

from typing import Sequence, Union

from sluice.postproc.parsers.base import Piece, TagSplitter, ToolParser, new_call_id
from sluice.postproc.parsers.calls import (DeepSeekV3Parser, GraniteParser, Llama3JsonParser, MistralParser,
                                           PythonicParser, Qwen3CoderParser)
from sluice.postproc.parsers.hermes import HermesParser
from sluice.postproc.parsers.reasoning import DeepSeekR1Parser, ThinkParser

TextParser = Union[ThinkParser, ToolParser]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser, "granite": GraniteParser,
    "deepseek_v3": DeepSeekV3Parser, "qwen3_coder": Qwen3CoderParser, "pythonic": PythonicParser,
}
REASONING_PARSERS: dict[str, type[ThinkParser]] = {"think": ThinkParser, "qwen3": ThinkParser,
                                                   "deepseek_r1": DeepSeekR1Parser}
TEXT_PARSERS: dict[str, type] = {**REASONING_PARSERS, **TOOL_PARSERS}


# Formats whose markers are special tokens in their models' vocabularies (Mistral's `[TOOL_CALLS]`, `[ARGS]`;
# DeepSeek's `<｜tool▁calls▁begin｜>` ...) and that cannot be read without them: their output is detokenized
# with its special tokens (as vLLM does for Mistral).
_NEEDS_SPECIAL_TOKENS = {"mistral", "deepseek_v3"}


def keeps_special_tokens(names: Sequence[str]) -> bool:
    return any(name in _NEEDS_SPECIAL_TOKENS for name in names)


def text_parser(name: str, parallel_tool_calls: bool = True,
                param_types: dict[str, dict[str, str]] | None = None) -> TextParser:
    """A parser by its name; a tool parser stops reading after its first call without parallel_tool_calls."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name](None if parallel_tool_calls else 1, param_types)
    return REASONING_PARSERS[name]()


__all__ = ["Piece", "TagSplitter", "ToolParser", "new_call_id", "HermesParser", "ThinkParser", "DeepSeekR1Parser",
           "TEXT_PARSERS", "TOOL_PARSERS", "REASONING_PARSERS", "text_parser", "keeps_special_tokens"]
