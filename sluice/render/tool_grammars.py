"""Grammars (llguidance's Lark) that hold a model's tool calls to their functions' schemas, in the model's
own call format: the text formats (one description each: FORMATS for those whose arguments are one JSON
object, hermes' `<tool_call>` blocks, Llama 3's JSON, Mistral's `[TOOL_CALLS]` lists, ...; PARAMS_FORMATS for
those that write each argument apart, qwen3_coder's XML parameters and pythonic's keywords), and harmony's
commentary-channel calls. A serving extension picks the format; the chat core asks it for the constraint
(render/extensions.py `tool_constraint`). A schema a format cannot hold (qwen3_coder's bare-text strings
with a pattern, say) raises Unholdable: a 400 naming `tools`, never a constraint that holds less.

- a named tool_choice: the call's opening is already in the prompt; the arguments must fit its schema;
- tool_choice "required": at least one call (exactly one with parallel_tool_calls false), to a given tool,
  with arguments that fit that tool's schema; reasoning before it stays free;
- strict tools under "auto": text is free, but a call, once it starts, must fit its tool's schema.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable
from typing import Literal as Kind
from typing import Sequence, Union

from sluice.base import tool_formats as formats
from sluice.schemas.openai import Tool

NO_WHITESPACE = {"whitespace_flexible": False}  # compact JSON, as OpenAI's strict mode writes it
Literal = Callable[[str], str]  # a piece of call syntax as a Lark terminal: a token <[id]> or a quoted string
Format = Union["CallFormat", "ParamsFormat"]


def arguments(tool: Tool, strict_only: bool = False) -> str:
    """The Lark for a tool's arguments: its parameters schema (any object when it has none, or when only
    strict tools are held and this one is not)."""
    schema = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    if strict_only and not tool.function.strict:
        schema = {"type": "object"}
    return "%json " + json.dumps({**schema, "x-guidance": NO_WHITESPACE}, sort_keys=True)


def _alternatives(rules: Sequence[str]) -> str:
    return "\n    | ".join(rules)


# ---- the text formats: one description each, one set of grammars for all ----------------------------------

@dataclass(frozen=True)
class CallFormat:
    """A text format whose calls carry their arguments as one JSON object: a turn's calls are `begin`, then
    each call as `opening(name)`, its arguments and `closing` (`separator` between two), then `end`.
    `placement`: where text may stand beside the calls: between them (hermes), before them (a marker starts
    them), or nowhere (the calls are the whole output). `trigger`: the text that starts the calls, which
    `begin` (or else each opening) starts with. `bare`: first characters of text that the family's parser
    also reads as calls without the trigger (so free text, where the calls are the whole output, never
    starts with them: the parser would read a call the grammar never held)."""
    trigger: str
    name_before: str
    name_after: str
    closing: str
    begin: str = ""
    separator: str = ""
    end: str = ""
    placement: Kind["between", "before", "whole"] = "before"
    quote_name: bool = True
    bare: str = ""

    def opening(self, name: str) -> str:
        return self.name_before + (json.dumps(name) if self.quote_name else name) + self.name_after

    def forced_prefix(self, name: str) -> str:
        """What the prompt ends with to force a call to `name`: the parsers read it first."""
        return self.begin + self.opening(name)

    def syntax(self) -> str:
        """All the format's own text (where to look for the vocabulary's tokens it uses)."""
        return self.trigger + self.begin + self.opening("") + self.closing + self.separator + self.end


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(formats.QWEN_OPEN, formats.QWEN_OPEN + '\n{"name": ', ', "arguments": ',
                         "}\n" + formats.QWEN_CLOSE, separator="\n", placement="between"),
    "llama3_json": CallFormat("{", '{"name": ', ', "parameters": ', "}", separator="; ", placement="whole"),
    "mistral": CallFormat(formats.TOOL_CALLS, '{"name": ', ', "arguments": ', "}", begin=formats.TOOL_CALLS + "[",
                          separator=", ", end="]"),
    "granite": CallFormat(formats.GRANITE_CALL, '{"name": ', ', "arguments": ', "}",
                          begin=formats.GRANITE_CALL + "[", separator=", ", end="]", placement="whole",
                          bare="[<"),  # (its parser reads a bare `[` and `<tool_call>[` too)
    "deepseek_v3": CallFormat(formats.DS_CALLS_BEGIN, formats.DS_CALL_BEGIN + "function" + formats.DS_SEP,
                              "\n```json\n", "\n```" + formats.DS_CALL_END, begin=formats.DS_CALLS_BEGIN,
                              separator="\n", end=formats.DS_CALLS_END, quote_name=False),
}


def _seq(lit: Literal, *parts: str) -> str:
    return " ".join(lit(p) for p in parts if p)


def _calls(fmt: CallFormat, tools: Sequence[Tool], lit: Literal, strict_only: bool, drop: str = "") -> list[str]:
    """Each tool's call (`drop`: the trigger, already read, left off each opening)."""
    return [f"{_seq(lit, fmt.opening(t.function.name)[len(drop):])} {arguments(t, strict_only)} "
            f"{_seq(lit, fmt.closing)}" for t in tools]


def named(fmt: Format, tool: Tool, lit: Literal) -> str:
    """After the prompt's forced opening (`forced_prefix`): the arguments, then the call's and the turn's end."""
    if isinstance(fmt, ParamsFormat):
        (call,) = _params_calls(fmt, [tool], lit, False, drop=fmt.opening(tool.function.name))
        return f"start: {call} {_seq(lit, fmt.end)}\n"
    return f"start: {arguments(tool)} {_seq(lit, fmt.closing, fmt.end)}\n"


def _call_rules(fmt: Format, tools: Sequence[Tool], lit: Literal, strict_only: bool, drop: str = "") -> list[str]:
    if isinstance(fmt, ParamsFormat):
        return _params_calls(fmt, tools, lit, strict_only, drop)
    return _calls(fmt, tools, lit, strict_only, drop)


def required(fmt: Format, tools: Sequence[Tool], lit: Literal, parallel: bool, think: str | None) -> str:
    """At least one call (exactly one without `parallel`), to one of the tools, its arguments fitting the
    tool's schema. `think`: the reasoning parser, whose block before the calls stays free (deepseek_r1's
    must come: what it reads before `</think>` is reasoning)."""
    sep = f"{_seq(lit, fmt.separator)} " if fmt.separator else ""
    head = {None: "", "deepseek_r1": "think"}.get(think, "think?")
    lines = [" ".join(p for p in ("start:", head, _seq(lit, fmt.begin), "calls", _seq(lit, fmt.end)) if p),
             "calls: call" + (f" ({sep}call)*" if parallel else ""),
             f"call: {_alternatives(_call_rules(fmt, tools, lit, False))}"]
    if think is not None:
        opening = f"{lit('<think>')}{'?' if think != 'think' else ''}"
        lines.append(f'think: {opening} /(.|\\n)*/ {lit("</think>")} /[ \\n]*/')
    return "\n".join(lines) + "\n"


def strict(fmt: Format, tools: Sequence[Tool], lit: Literal) -> str:
    """Free text, and each call, once the format's trigger starts it, fits its tool's schema (non-strict
    tools: any object)."""
    trigger = lit(fmt.trigger)
    token = trigger.startswith("<[")  # a token of its own: no text can spell it, so it ends the text before it
    sep = f"{_seq(lit, fmt.separator)} " if fmt.separator else ""
    lines = [f"calls: call ({sep}call)*", f"call: {_alternatives(_call_rules(fmt, tools, lit, True))}",
             "TEXT: /(.|\\n)*/"]
    if fmt.placement == "between":  # every call starts with the trigger
        body = _alternatives(_call_rules(fmt, tools, lit, True, fmt.trigger))
        head = "(TEXT call)* TEXT" if token else "(text_then_tag call_body)* TEXT"
        lines = [f"start: {head}", f"call: {trigger} call_body", f"call_body: {body}", "TEXT: /(.|\\n)*/"]
    elif fmt.placement == "before":  # the turn's calls start with the trigger (`begin` does)
        rest = f"{_seq(lit, fmt.begin[len(fmt.trigger):])} calls {_seq(lit, fmt.end)}"
        lines += [f"start: TEXT | TEXT {trigger} rest" if token else "start: TEXT | text_then_tag rest",
                  f"rest: {rest}"]
    else:  # the calls are the whole output, or there are none: free text that does not start with the trigger
        first = ("" if token else fmt.trigger[0]) + fmt.bare
        free = f"/\\s*([^\\s{re.escape(first)}](.|\\n)*)?/" if first else "/(.|\\n)*/"
        lines += [f"start: FREE | {_seq(lit, fmt.begin)} calls {_seq(lit, fmt.end)}", f"FREE: {free}"]
    if not token and fmt.placement != "whole":
        lines.append(f"text_then_tag[lazy]: TEXT {trigger}")
    return "\n".join(lines) + "\n"


# ---- the formats that write each argument apart: qwen3_coder's parameters, pythonic's keywords ---------------

class Unholdable(ValueError):
    """A schema the format's grammar cannot hold (its message says which tool and why)."""


@dataclass(frozen=True)
class ParamsFormat:
    """A text format whose calls write each argument apart: `call_open(name)`, then each argument as
    `param_open(key)` value `param_close` (`param_sep` between two), then `call_close`; a turn's calls sit
    between `begin` and `end`, `separator` between two. `raw_strings`: a string argument is its bare text
    (qwen3_coder); else every value is JSON (Python's literals, for pythonic, read the same)."""
    trigger: str
    call_open: str  # with {name}
    param_open: str  # with {key}
    param_close: str
    call_close: str
    param_sep: str = ""
    begin: str = ""
    separator: str = ""
    end: str = ""
    placement: Kind["between", "before", "whole"] = "between"
    raw_strings: bool = False
    bare: str = ""  # as CallFormat's

    def opening(self, name: str) -> str:
        return self.call_open.replace("{name}", name)

    def forced_prefix(self, name: str) -> str:
        return self.begin + self.opening(name)

    def syntax(self) -> str:
        return "".join((self.trigger, self.begin, self.call_open, self.param_open, self.param_close,
                        self.call_close, self.separator, self.end))


PARAMS_FORMATS: dict[str, ParamsFormat] = {
    "qwen3_coder": ParamsFormat(formats.QWEN_OPEN, formats.QWEN_OPEN + "\n<function={name}>\n", "<parameter={key}>\n",
                                "\n</parameter>\n", "</function>\n" + formats.QWEN_CLOSE, separator="\n",
                                raw_strings=True),
    "pythonic": ParamsFormat("[", "{name}(", "{key}=", "", ")", param_sep=", ", begin="[", separator=", ", end="]",
                             placement="whole"),
}
_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength", "enum", "const", "default", "examples"}


def _value(fmt: ParamsFormat, schema: dict, defs: dict, lit: Literal) -> str:
    """One argument's value and the end of the argument: the schema's JSON; qwen3_coder's strings as bare
    text, which a grammar holds only for their lengths or their listed values."""
    close = _seq(lit, fmt.param_close)
    if fmt.raw_strings and isinstance(schema, dict):
        schema = _as_read(schema)
    listed = schema.get("enum", [schema["const"]] if "const" in schema else None) if isinstance(schema, dict) else None
    text = isinstance(schema, dict) and (schema.get("type") == "string" or "type" not in schema and listed
                                         and all(isinstance(v, str) for v in listed))
    if fmt.raw_strings and isinstance(schema, dict) and not text and "type" not in schema:
        return _text_value(fmt)  # (any value: as text)
    if not (fmt.raw_strings and text):
        return "%json " + json.dumps({**schema, **({"$defs": defs} if defs else {}), "x-guidance": NO_WHITESPACE},
                                     sort_keys=True) + f" {close}"
    if set(schema) - _STRING_KEYS:
        raise Unholdable(f"{sorted(set(schema) - _STRING_KEYS)} of a string argument")
    if listed is not None:
        if not all(isinstance(v, str) for v in listed):
            raise Unholdable("an enum of values that are not strings")
        return "(" + " | ".join(lit(v) for v in listed) + f") {close}"
    return _text_value(fmt, schema.get("minLength", 0), schema.get("maxLength"))


def _as_read(schema: dict) -> dict:
    """A value's schema as qwen3_coder's parser reads the value: by the first of its types besides null (text
    for a string, and for no type at all); a schema it would misread cannot be held."""
    kind = schema.get("type")
    if isinstance(kind, list):
        if len(set(kind) - {"null"}) != 1:
            raise Unholdable(f"a value of the types {kind}")
        if "string" in kind:  # (as text: never null)
            return {**schema, "type": "string"}
    listed = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if kind is None and not (listed and all(isinstance(v, str) for v in listed)) \
            and set(schema) - {"description", "title", "default", "examples"}:
        raise Unholdable("a value with no type that is not text (the parser reads it as text)")
    return schema


def _text_value(fmt: ParamsFormat, low: int = 0, high: int | None = None) -> str:
    """Bare text and the argument's end as one terminal: the lexer takes terminals whole, so the text's own
    end is where the closing begins (the text holds no `<`)."""
    close = re.escape(fmt.param_close).replace("\n", "n").replace("/", "\\/")  # (re.escape: "\\" + newline)
    return f"/[^<]{{{low},{'' if high is None else high}}}{close}/"


def _params(fmt: ParamsFormat, tool: Tool, lit: Literal, strict_only: bool) -> str:
    """A call's arguments: the required ones first, in the schema's order, then any of the optional ones."""
    schema = tool.function.parameters or {"type": "object"}
    free = strict_only and not tool.function.strict
    props = schema.get("properties") or {}
    if free or (not props and schema.get("additionalProperties", True) is not False):
        key = "/[A-Za-z_][A-Za-z0-9_]*/"
        value = _text_value(fmt) if fmt.raw_strings else f"%json {{}} {_seq(lit, fmt.param_close)}"
        before, after = fmt.param_open.split("{key}")
        one = f"{_seq(lit, before)} {key} {_seq(lit, after)} {value}"
        sep = _seq(lit, fmt.param_sep)
        return f"({one} ({sep} {one})*)?" if sep else f"({one})*"
    if set(schema) - {"type", "properties", "required", "additionalProperties", "$defs", "description", "title"}:
        raise Unholdable("a parameters schema beyond properties and required")
    defs = schema.get("$defs") or {}
    items = {k: f"{_seq(lit, fmt.param_open.replace('{key}', k))} {_value(fmt, v, defs, lit)}"
             for k, v in props.items()}
    required = [k for k in props if k in (schema.get("required") or [])]
    optional = [k for k in props if k not in required]
    sep = f"{_seq(lit, fmt.param_sep)} " if fmt.param_sep else ""
    head = f" {sep}".join(items[k] for k in required)

    def tail(keys: list[str]) -> str:
        return " ".join(f"({sep}{items[k]})?" for k in keys)

    if head:
        return f"{head} {tail(optional)}"
    if not optional:
        return ""
    return "(" + " | ".join(f"{items[k]} {tail(optional[i + 1:])}" for i, k in enumerate(optional)) + ")?"


def _params_calls(fmt: ParamsFormat, tools: Sequence[Tool], lit: Literal, strict_only: bool,
                  drop: str = "") -> list[str]:
    """Each tool's call (`drop`: the trigger, already read, left off each opening)."""
    out = []
    for t in tools:
        try:
            out.append(f"{_seq(lit, fmt.opening(t.function.name)[len(drop):])} {_params(fmt, t, lit, strict_only)} "
                       f"{_seq(lit, fmt.call_close)}")
        except Unholdable as e:
            raise Unholdable(f"tool {t.function.name!r}: its format cannot hold {e}") from None
    return out


ALL_FORMATS: dict[str, Format] = {**FORMATS, **PARAMS_FORMATS}


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
