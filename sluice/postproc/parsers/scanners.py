"""The scanners of the tool-call formats that are read a call at a time (calls.py): each reads a region (the text
from the format's marker on) again whole each time text comes, and says which calls it holds, where they
end, whether more may come, and which call is being written, if it streams."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Callable, Literal

from sluice.base import tool_formats as formats
from sluice.postproc.parsers.base import partial_suffix
from sluice.postproc.parsers.values import python_calls, typed_value

Status = Literal["open", "closed", "bad"]


@dataclass
class Partial:
    """A call being written whose name is read and whose arguments object has begun: it streams (a call so
    begun is a call, whatever follows: its start has gone out)."""
    name: str
    start: int  # where its arguments' text starts
    end: int  # where the text of them so far ends (the object's end, once it has one)


@dataclass
class Scan:
    """What a scanner found in a region (the text from the marker on)."""
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), each complete
    end: int  # where the text after the last complete call (or after the region, once closed) starts
    status: Status  # open: more may come; closed: the region ended at `end`; bad: it is not the format's
    partial: Partial | None = None  # the call after `calls` that is being written, if it streams


Scanner = Callable[[str, bool, dict[str, dict[str, str]]], Scan]

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def _skip(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _object(text: str, pos: int) -> tuple[dict | None, int]:
    """The JSON object at pos and where it ends; None when there is none (yet)."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None, pos
    return (obj, end) if isinstance(obj, dict) else (None, pos)


def _named(obj: dict, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object {"name": ..., "arguments" (or another key): {...}}."""
    name = obj.get("name")
    args: object = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(name, str) or not isinstance(args, (dict, str)):
        return None
    return name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


@functools.cache
def _call_start(keys: tuple[str, ...]) -> re.Pattern[str]:
    """A call object written name first, up to its arguments object's `{`."""
    return re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + "|".join(keys) + r')"\s*:\s*(?=\{)')


def _arguments(text: str, start: int, stop: int | None = None) -> tuple[int, bool]:
    """Where the arguments object at `start` ends, and whether it has (else: `stop`, or the text's end)."""
    args, end = _object(text, start)
    return (end, True) if args is not None else (len(text) if stop is None else stop, False)


def _streaming(text: str, pos: int, keys: tuple[str, ...]) -> tuple[Partial, bool] | None:
    """The call object at pos, if it streams (written name first, its arguments an object), and whether its
    arguments are whole."""
    start = _call_start(keys).match(text, pos)
    if start is None:
        return None
    try:
        name = json.loads(f'"{start.group(1)}"')
    except ValueError:
        return None
    end, whole = _arguments(text, start.end())
    return Partial(name, start.end(), end), whole


def _json_call(text: str, pos: int, final: bool, keys: tuple[str, ...]) -> tuple[tuple[str, str] | None, int, Scan]:
    """The call object at pos: (the call, its end, Scan()) once complete; else (None, pos, what to answer: a
    Scan without its calls)."""
    streaming = _streaming(text, pos, keys)
    if streaming is not None and not streaming[1]:  # (its arguments are not whole: nor is the call)
        return None, pos, Scan([], 0, "bad" if final else "open", streaming[0])
    obj, after = _object(text, pos)
    if obj is None:
        status: Status = "bad" if final or text[pos:pos + 1] not in ("", "{") else "open"
        return None, pos, Scan([], 0, "bad" if final else "open", streaming[0]) if streaming else Scan([], 0, status)
    if streaming is not None:
        partial = streaming[0]
        return (partial.name, text[partial.start:partial.end]), after, Scan([], 0, "open")
    call = _named(obj, keys)
    return call, after, Scan([], 0, "bad") if call is None else Scan([], 0, "open")


def _json_list(text: str, pos: int, final: bool, keys: tuple[str, ...]) -> Scan:
    """A JSON list of call objects starting at pos (`[`): its calls, the end of the last one read (of the list,
    once closed), and whether it is closed."""
    calls: list[tuple[str, str]] = []
    end, p = pos, pos + 1
    while True:
        p = _skip(text, p)
        if p == len(text):
            return Scan(calls, end, "open")
        if text[p] == "]":
            return Scan(calls, p + 1, "closed")
        if calls:
            if text[p] != ",":
                return Scan(calls, end, "bad")
            p = _skip(text, p + 1)
        call, after, scan = _json_call(text, p, final, keys)
        if call is None:
            return Scan(calls, end, scan.status, scan.partial)
        calls.append(call)
        end = p = after


def _past_marker(text: str, p: int, marker: str) -> int | None:
    """Where the next call begins: past whitespace and an optional `marker`; None while the text ends there or
    inside the marker (the scan stays open)."""
    p = _skip(text, p)
    if text.startswith(marker, p):
        p = _skip(text, p + len(marker))
    return None if p == len(text) or marker.startswith(text[p:]) else p


def scan_llama3(text: str, final: bool, _: dict) -> Scan:
    """`<|python_tag|>`? then `{"name": ..., "parameters": {...}}`, several separated by `;`."""
    calls: list[tuple[str, str]] = []
    end = p = 0
    while True:
        if (start := _past_marker(text, p, formats.PYTHON_TAG)) is None:
            return Scan(calls, end, "open")
        p = start
        if text[p] != "{":
            return Scan(calls, end, "closed" if calls else "bad")
        call, after, scan = _json_call(text, p, final, ("parameters", "arguments"))
        if call is None:
            return Scan(calls, end, scan.status, scan.partial)
        calls.append(call)
        end = p = after
        p = _skip(text, p)
        if p == len(text):
            return Scan(calls, end, "open")
        if text[p] != ";":
            return Scan(calls, end, "closed")
        p += 1


_MISTRAL_NAME = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")
_MISTRAL_NAME_PART = re.compile(r"[A-Za-z0-9_.\-]*(\[(A(R(GS?)?)?)?)?\Z")


def scan_mistral(text: str, final: bool, _: dict) -> Scan:
    """`[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or (tokenizer v11 on) `name[ARGS]{...}`, each call
    after a `[TOOL_CALLS]` of its own."""
    calls: list[tuple[str, str]] = []
    end = p = 0
    while True:
        if (start := _past_marker(text, p, formats.TOOL_CALLS)) is None:
            return Scan(calls, end, "open")
        p = start
        rest = text[p:]
        if rest[0] == "[":
            found = _json_list(text, p, final, ("arguments",))
            calls += found.calls
            if found.status != "closed":
                return Scan(calls, found.end, found.status, found.partial)
            p = end = found.end
            continue
        named = _MISTRAL_NAME.match(text, p)
        if named is None:
            cut = not final and _MISTRAL_NAME_PART.match(rest)
            return Scan(calls, end, "open" if cut else "closed" if calls else "bad")
        start = _skip(text, named.end())
        if text[start:start + 1] != "{":
            return Scan(calls, end, "bad" if final or start < len(text) else "open")
        args_end, whole = _arguments(text, start)
        if not whole:
            return Scan(calls, end, "bad" if final else "open", Partial(named.group(1), start, args_end))
        calls.append((named.group(1), text[start:args_end]))
        end = p = args_end


def scan_granite(text: str, final: bool, _: dict) -> Scan:
    """`<|tool_call|>` then a JSON list of {"name", "arguments"}."""
    p = _skip(text, 0)
    for marker in (formats.GRANITE_CALL, "<tool_call>"):
        if text.startswith(marker, p):
            p = _skip(text, p + len(marker))
            break
    if p == len(text):
        return Scan([], 0, "open")
    if text[p] != "[":
        return Scan([], 0, "bad")
    return _json_list(text, p, final, ("arguments",))


def scan_deepseek(text: str, final: bool, _: dict) -> Scan:
    """`<｜tool▁calls▁begin｜>`, then calls
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
    (V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`), `<｜tool▁calls▁end｜>`."""
    calls: list[tuple[str, str]] = []
    end = p = _skip(text, 0) + len(formats.DS_CALLS_BEGIN)
    while True:
        p = _skip(text, p)
        rest = text[p:]
        if rest.startswith(formats.DS_CALLS_END):
            return Scan(calls, p + len(formats.DS_CALLS_END), "closed")
        if not rest or formats.DS_CALLS_END.startswith(rest) or formats.DS_CALL_BEGIN.startswith(rest):
            return Scan(calls, end, "open")
        if not rest.startswith(formats.DS_CALL_BEGIN):
            return Scan(calls, end, "closed" if calls else "bad")
        close = text.find(formats.DS_CALL_END, p)
        partial = _deepseek_streaming(text, p, close)
        if close < 0:
            return Scan(calls, end, "bad" if final and partial else "open", partial)
        call = _deepseek_call(text[p + len(formats.DS_CALL_BEGIN):close]) if partial is None else \
            (partial.name, text[partial.start:partial.end])
        if call is None:
            return Scan(calls, end, "bad")
        calls.append(call)
        end = p = close + len(formats.DS_CALL_END)


# A call that streams: V3.1's (`NAME<｜tool▁sep｜>{`), or V3's (`function<｜tool▁sep｜>NAME`, a json fence, `{`);
# V3.1's first: where both match, its match ends first.
# (A name holds no `｜`, which every marker does: a match never runs into the next call.)
_DS_STARTS = (re.compile(re.escape(formats.DS_CALL_BEGIN) + r"([^\n｜]*?)" + re.escape(formats.DS_SEP) + r"\s*(?=\{)"),
              re.compile(re.escape(formats.DS_CALL_BEGIN) + r"\s*function\s*" + re.escape(formats.DS_SEP)
                         + r"([^\n｜]*)\n\s*```(?:json)?\s*(?=\{)"))


def _deepseek_streaming(text: str, pos: int, close: int) -> Partial | None:
    """The call at pos, if it streams; its arguments' text so far ends where the object does, or else at the
    call's end (`close`, -1: not yet), never in what may be the start of the end marker."""
    for pattern in _DS_STARTS:
        if (start := pattern.match(text, pos)) is not None and (name := start.group(1).strip()):
            stop = close if close >= 0 else len(text) - partial_suffix(text, formats.DS_CALL_END)
            return Partial(name, start.end(), _arguments(text[:stop], start.end(), stop)[0])
    return None


_FENCED = re.compile(r"\s*```(?:json)?\s*\n?(.*?)\s*```\s*\Z", re.DOTALL)


def _deepseek_call(block: str) -> tuple[str, str] | None:
    head, sep, body = block.partition(formats.DS_SEP)
    if not sep:
        return None
    if head.strip() == "function" and "\n" in body:  # V3: the name, then the arguments in a fence
        name, _, body = body.partition("\n")
        fenced = _FENCED.match(body)
        body = fenced.group(1) if fenced else body
    else:
        name = head
    try:
        args = json.loads(body)
    except ValueError:
        return None
    return (name.strip(), json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) and name.strip() else None


_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def scan_qwen3_coder(text: str, final: bool, types: dict[str, dict[str, str]]) -> Scan:
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`, blocks one after
    another; each value read as its parameter's schema type says."""
    calls: list[tuple[str, str]] = []
    end = p = 0
    while True:
        p = _skip(text, p)
        rest = text[p:]
        if not rest or (calls and formats.QWEN_OPEN.startswith(rest)):
            return Scan(calls, end, "open")
        if not rest.startswith(formats.QWEN_OPEN):
            return Scan(calls, end, "closed")
        close = text.find(formats.QWEN_CLOSE, p)
        if close < 0:
            return Scan(calls, end, "open")
        block = _QWEN_FUNCTION.match(text, p + len(formats.QWEN_OPEN), close)
        if block is None:
            return Scan(calls, end, "bad")
        name = block.group(1).strip()
        schema = types.get(name, {})
        args = {k.strip(): typed_value(_strip_newline(v), schema.get(k.strip()))
                for k, v in _QWEN_PARAMETER.findall(block.group(2))}
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        end = p = close + len(formats.QWEN_CLOSE)


def _strip_newline(value: str) -> str:
    """A value as the template writes it: one newline after the opening tag and one before the closing one."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def scan_pythonic(text: str, final: bool, _: dict) -> Scan:
    """`[f(a=1, b="x"), g()]` (Llama 4: between `<|python_start|>` and `<|python_end|>`), read with ast."""
    p = _skip(text, 0)
    wrapped = text.startswith(formats.PYTHON_START, p)
    if wrapped:
        p += len(formats.PYTHON_START)
    close = p
    while (close := text.find("]", close) + 1) > 0:
        try:
            calls = python_calls(text[p:close])
        except ValueError:
            return Scan([], p, "bad")
        if calls is not None:
            after = _skip(text, close)
            if text.startswith(formats.PYTHON_END, after):
                close = after + len(formats.PYTHON_END)
            elif wrapped and not final and formats.PYTHON_END.startswith(text[after:]):
                return Scan([], p, "open")
            return Scan(calls, close, "closed")
    return Scan([], p, "bad" if final else "open")
