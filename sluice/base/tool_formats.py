"""The tool-call and reasoning formats of the model families, as data both sides share: render (the grammars
that hold forced and strict calls, the choice of parser from a chat template) and postproc (the parsers)."""
from __future__ import annotations

from typing import Literal

ToolParserName = Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "pythonic", "granite"]
ReasoningParserName = Literal["think", "qwen3", "deepseek_r1"]
TOOL_PARSERS: tuple[str, ...] = ToolParserName.__args__  # type: ignore[attr-defined]
REASONING_PARSERS: tuple[str, ...] = ReasoningParserName.__args__  # type: ignore[attr-defined]
AUTO = "auto"

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1-3.3
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's pythonic calls
TOOL_CALLS = "[TOOL_CALLS]"  # Mistral
GRANITE_CALL = "<|tool_call|>"
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"  # hermes and qwen3_coder
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# What a chat template writes when it shows the model its call format, most specific first: the first that a
# template mentions names its parser (`<function=` before `<tool_call>`: Qwen3-Coder's template has both).
TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),
    (DS_CALLS_BEGIN, "deepseek_v3"),
    (GRANITE_CALL, "granite"),
    (TOOL_CALLS, "mistral"),
    (PYTHON_TAG, "llama3_json"),
    (QWEN_OPEN, "hermes"),
)


def tool_parser_of(template: str | None) -> str | None:
    """The tool parser a chat template shows the model (None: it shows none of the formats, or more than one
    that are not nested)."""
    found = [name for marker, name in TOOL_MARKERS if template and marker in template]
    if found[:2] == ["qwen3_coder", "hermes"]:  # `<function=` inside `<tool_call>` blocks: one format
        found = found[:1] + found[2:]
    return found[0] if len(found) == 1 else None


def reasoning_parser_of(template: str | None) -> str | None:
    """The reasoning parser a chat template implies: Qwen3's reads `enable_thinking`; any other that writes
    `</think>` gets `think`. Never deepseek_r1, which reads all of an output without `</think>` as reasoning:
    DeepSeek-V3.1's template closes the block in the prompt when it does not think, and `think` reads a
    block the prompt opened (R1's) as well."""
    if not template or "</think>" not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "think"
