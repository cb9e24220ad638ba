"""Grammars (llguidance's Lark) that hold a model's tool calls to their functions' schemas, in the model's
own call format: hermes' `<tool_call>` blocks, harmony's commentary-channel calls. A serving extension
picks the format; the chat core asks it for the constraint (render/extensions.py `tool_constraint`).

- a named tool_choice: the call's opening is already in the prompt; the arguments must fit its schema;
- tool_choice "required": at least one call (exactly one with parallel_tool_calls false), to a given tool,
  with arguments that fit that tool's schema; reasoning before it stays free;
- strict tools under "auto": text is free, but a call, once it starts, must fit its tool's schema.
"""
from __future__ import annotations

import json
from typing import Callable, Sequence

from ipc.openai import Tool

NO_WHITESPACE = {"whitespace_flexible": False}  # compact JSON, as OpenAI's strict mode writes it
Literal = Callable[[str], str]  # a piece of call syntax as a Lark terminal: a token <[id]> or a quoted string


def arguments(tool: Tool, strict_only: bool = False) -> str:
    """The Lark for a tool's arguments: its parameters schema (any object when it has none, or when only
    strict tools are held and this one is not)."""
    schema = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    if strict_only and not tool.function.strict:
        schema = {"type": "object"}
    return "%json " + json.dumps({**schema, "x-guidance": NO_WHITESPACE}, sort_keys=True)


def _alternatives(rules: Sequence[str]) -> str:
    return "\n    | ".join(rules)


# ---- hermes: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> -------------------------------------

def hermes_call_opening(name: str) -> str:
    return '\n{"name": ' + json.dumps(name) + ', "arguments": '


def hermes_named(tool: Tool, lit: Literal) -> str:
    """After the prompt's forced opening: the arguments, then the block's end."""
    return f'start: {arguments(tool)} {lit("}")} {lit(chr(10))} {lit("</tool_call>")}\n'


def hermes_required(tools: Sequence[Tool], lit: Literal, parallel: bool, think: bool) -> str:
    calls = [f'{lit("<tool_call>")} {lit(hermes_call_opening(t.function.name))} {arguments(t)} {lit("}")} '
             f'{lit(chr(10))} {lit("</tool_call>")}' for t in tools]
    lines = [f"start: {'think? ' if think else ''}calls",
             'calls: call' + (' (/\\n+/ call)*' if parallel else ''),
             f"call: {_alternatives(calls)}"]
    if think:  # a reasoning parser reads it: the text between the tags is free
        lines.append(f'think: {lit("<think>")} /(.|\\n)*/ {lit("</think>")} /[ \\n]*/')
    return "\n".join(lines) + "\n"


def hermes_strict(tools: Sequence[Tool], lit: Literal) -> str:
    """Free text, in which each call, once its tag opens, fits its tool's schema (non-strict tools: any
    object)."""
    calls = [f'{lit(hermes_call_opening(t.function.name))} {arguments(t, strict_only=True)} {lit("}")} '
             f'{lit(chr(10))} {lit("</tool_call>")}' for t in tools]
    opening = lit("<tool_call>")
    if opening.startswith("<["):  # a token of its own: it cannot be text, so it ends the text before it
        lines = ["start: (TEXT call)* TEXT", f"call: {opening} call_body"]
    else:  # text: the free text stops where the tag begins (a lazy lexeme)
        lines = ["start: (text_then_tag call_body)* TEXT", f"text_then_tag[lazy]: TEXT {opening}"]
    lines += [f"call_body: {_alternatives(calls)}", "TEXT: /(.|\\n)*/"]
    return "\n".join(lines) + "\n"


# ---- harmony: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|> -------------

def harmony_named(tool: Tool) -> str:
    """After the prompt's forced opening: the arguments, then the end of the call."""
    return f"start: {arguments(tool)} <|call|>\n"


_HARMONY_TEXT = [
    'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"',
    'preamble: <|channel|> "commentary" <|message|> TEXT <|end|> <|start|> "assistant"',
    "TEXT: /(.|\\n)*/",
]


def _harmony_calls(tools: Sequence[Tool], strict_only: bool) -> list[str]:
    fns = [f'{json.dumps(t.function.name)} " " <|constrain|> "json" <|message|> {arguments(t, strict_only)} <|call|>'
           for t in tools]
    return ['call: <|channel|> "commentary to=functions." fn', f"fn: {_alternatives(fns)}"]


def harmony_required(tools: Sequence[Tool]) -> str:
    """Reasoning (and preambles) free, then a call to one of the tools."""
    return "\n".join(["start: (analysis | preamble)* call", *_harmony_calls(tools, False), *_HARMONY_TEXT]) + "\n"


def harmony_strict(tools: Sequence[Tool]) -> str:
    """Reasoning free; then a final answer (free), or a call that fits its tool's schema."""
    final = 'final: <|channel|> "final" <|message|> TEXT <|return|>'
    return "\n".join(["start: (analysis | preamble)* (final | call)", final, *_harmony_calls(tools, True),
                      *_HARMONY_TEXT]) + "\n"
