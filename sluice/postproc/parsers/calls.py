"""Tool-call formats that are read a call at a time: text is content until the format's marker, then a scanner
reads the calls after it (`llama3_json`, `mistral`, `granite`, `deepseek_v3`, `qwen3_coder`, `pythonic`).

A call goes out whole (name and arguments in one delta) as soon as its text is complete. The scanner reads
the whole region again each time text comes, so what it finds depends only on the text so far, never on
how it was chunked.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Literal

from sluice.base import tool_formats as formats
from sluice.postproc.parsers.base import Piece, ToolParser, partial_suffix
from sluice.postproc.parsers.values import python_calls, typed_value

Status = Literal["open", "closed", "bad"]


@dataclass
class Scan:
    """What a scanner found in a region (the text from the marker on)."""
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), each complete
    end: int  # where the text after the last complete call (or after the region, once closed) starts
    status: Status  # open: more may come; closed: the region ended at `end`; bad: it is not the format's


Scanner = Callable[[str, bool, dict[str, dict[str, str]]], Scan]


@dataclass(frozen=True)
class CallFormat:
    markers: tuple[str, ...]  # any of these starts the region
    scan: Scanner
    at_start: bool  # the calls must be the whole output (whitespace aside); else text may come before them


class CallsParser(ToolParser):
    """Content until a marker, then the format's calls; a region that turns out not to be the format's is given
    back as content, and so is what is left of one that ends short."""

    fmt: CallFormat

    def __init__(self, max_calls: int | None = None, param_types: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__(max_calls, param_types)
        self._mode: Literal["start", "text", "calls", "plain"] = "start" if self.fmt.at_start else "text"
        self._buf = ""  # text not yet given out (in "calls": the region)
        self._sent = 0  # calls of the region given out

    def feed(self, piece: Piece, final: bool = False) -> Piece:
        out = Piece(reasoning=piece.reasoning, tool_calls=list(piece.tool_calls))
        self._buf += piece.content
        while not self.done and self._step(out, final):
            pass
        return out

    def _step(self, out: Piece, final: bool) -> bool:
        """Reads what it can of the buffer; whether to go on."""
        buf, markers = self._buf, self.fmt.markers
        if self._mode == "plain":
            out.content, self._buf = out.content + buf, ""
        elif self._mode == "start":
            text = buf.lstrip()
            if any(text.startswith(m) for m in markers):
                self._mode, self._buf, self._sent = "calls", text, 0
                return True
            if not final and (not text or any(m.startswith(text) for m in markers)):
                return False
            self._mode = "plain"
            return True
        elif self._mode == "text":
            at = min((i for i in (buf.find(m) for m in markers) if i >= 0), default=-1)
            if at >= 0:
                out.content += buf[:at]
                self._mode, self._buf, self._sent = "calls", buf[at:], 0
                return True
            keep = 0 if final else max(partial_suffix(buf, m) for m in markers)
            out.content, self._buf = out.content + buf[: len(buf) - keep], buf[len(buf) - keep:]
        else:
            return self._read_calls(out, final)
        return False

    def _read_calls(self, out: Piece, final: bool) -> bool:
        scan = self.fmt.scan(self._buf, final, self.param_types)
        if scan.status == "bad" and not scan.calls:
            self._mode = "plain"
            return True
        for name, arguments in scan.calls[self._sent:]:
            self._emit(out, name, arguments)
            self._sent += 1
            if self.done:
                return False
        if scan.status == "open" and not final:
            return False
        rest = self._buf[scan.end:]
        if scan.status == "closed":
            self._mode = "start" if self.fmt.at_start else "text"
        else:  # bad after good calls, or cut short: what is left is text, unless it is only the format's punctuation
            self._mode, rest = "plain", rest if rest.strip(" \n\t;,]") else ""
        self._buf = rest
        return True


# ---- the formats' scanners ----------------------------------------------------------------------------------

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


def _json_list(text: str, pos: int, final: bool, keys: tuple[str, ...]) -> tuple[list[tuple[str, str]], int, Status]:
    """A JSON list of call objects starting at pos (`[`): its calls, the end of the last one read (of the list,
    once closed), and whether it is closed."""
    calls: list[tuple[str, str]] = []
    end, p = pos, pos + 1
    while True:
        p = _skip(text, p)
        if p == len(text):
            return calls, end, "open"
        if text[p] == "]":
            return calls, p + 1, "closed"
        if calls:
            if text[p] != ",":
                return calls, end, "bad"
            p = _skip(text, p + 1)
        obj, after = _object(text, p)
        if obj is None:
            return calls, end, "bad" if final or text[p:p + 1] not in ("", "{") else "open"
        call = _named(obj, keys)
        if call is None:
            return calls, end, "bad"
        calls.append(call)
        end = p = after


def scan_llama3(text: str, final: bool, _: dict) -> Scan:
    """`<|python_tag|>`? then `{"name": ..., "parameters": {...}}`, several separated by `;`."""
    calls: list[tuple[str, str]] = []
    end = p = 0
    while True:
        p = _skip(text, p)
        if text.startswith(formats.PYTHON_TAG, p):
            p = _skip(text, p + len(formats.PYTHON_TAG))
        if p == len(text) or formats.PYTHON_TAG.startswith(text[p:]):
            return Scan(calls, end, "open")
        if text[p] != "{":
            return Scan(calls, end, "closed" if calls else "bad")
        obj, after = _object(text, p)
        if obj is None:
            return Scan(calls, end, "bad" if final else "open")
        call = _named(obj, ("parameters", "arguments"))
        if call is None:
            return Scan(calls, end, "bad")
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
        p = _skip(text, p)
        if text.startswith(formats.TOOL_CALLS, p):
            p = _skip(text, p + len(formats.TOOL_CALLS))
        rest = text[p:]
        if not rest or formats.TOOL_CALLS.startswith(rest):
            return Scan(calls, end, "open")
        if rest[0] == "[":
            found, end, status = _json_list(text, p, final, ("arguments",))
            calls += found
            if status != "closed":
                return Scan(calls, end, status)
            p = end
            continue
        named = _MISTRAL_NAME.match(text, p)
        if named is None:
            partial = not final and _MISTRAL_NAME_PART.match(rest)
            return Scan(calls, end, "open" if partial else "closed" if calls else "bad")
        obj, after = _object(text, named.end())
        if obj is None:
            return Scan(calls, end, "bad" if final or text[named.end():].strip()[:1] not in ("", "{") else "open")
        calls.append((named.group(1), json.dumps(obj, ensure_ascii=False)))
        end = p = after


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
    calls, end, status = _json_list(text, p, final, ("arguments",))
    return Scan(calls, end, status)


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
        if close < 0:
            return Scan(calls, end, "open")
        call = _deepseek_call(text[p + len(formats.DS_CALL_BEGIN):close])
        if call is None:
            return Scan(calls, end, "bad")
        calls.append(call)
        end = p = close + len(formats.DS_CALL_END)


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


class Llama3JsonParser(CallsParser):
    fmt = CallFormat((formats.PYTHON_TAG, "{"), scan_llama3, at_start=True)


class MistralParser(CallsParser):
    fmt = CallFormat((formats.TOOL_CALLS,), scan_mistral, at_start=False)


class GraniteParser(CallsParser):
    fmt = CallFormat((formats.GRANITE_CALL, "<tool_call>", "["), scan_granite, at_start=True)


class DeepSeekV3Parser(CallsParser):
    fmt = CallFormat((formats.DS_CALLS_BEGIN,), scan_deepseek, at_start=False)


class Qwen3CoderParser(CallsParser):
    fmt = CallFormat((formats.QWEN_OPEN,), scan_qwen3_coder, at_start=False)


class PythonicParser(CallsParser):
    fmt = CallFormat((formats.PYTHON_START, "["), scan_pythonic, at_start=True)
