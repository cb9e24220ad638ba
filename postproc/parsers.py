"""Chat output parsers. Each turns the model's output into pieces of a message:
content, reasoning, and tool-call deltas. Streaming a request merges the pieces
into deltas as they come; a non-streaming request merges the same pieces into
one message, so both give the same message for the same tokens.

Text parsers (`think`, `hermes`) work on detokenized text and hold back text
that could be the start of a tag, so any chunking gives the same result.
"""
from __future__ import annotations

import json
import re
import uuid

import msgspec

from ipc.openai import FunctionCallOut, ToolCallOut


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Piece(msgspec.Struct):  # a Struct: made a few times a token, and its init is C
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallOut] = []  # deltas, each naming its call's index (a new list each Piece)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "Piece") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TagSplitter:
    """Splits streamed text into (inside, text) segments around open/close tags; a tag is (inside, None)."""

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.tags = (open_tag, close_tag)
        self.inside = False
        self._held = ""

    def feed(self, text: str) -> list[tuple[bool, str | None]]:
        buf, out = self._held + text, list[tuple[bool, str | None]]()
        while True:
            tag = self.tags[self.inside]
            i = buf.find(tag)
            if i < 0:
                keep = _partial_suffix(buf, tag)
                self._held = buf[len(buf) - keep:]
                if len(buf) > keep:
                    out.append((self.inside, buf[: len(buf) - keep]))
                return out
            if i:
                out.append((self.inside, buf[:i]))
            self.inside = not self.inside
            out.append((self.inside, None))  # the tag itself: (True, None) opens, (False, None) closes
            buf = buf[i + len(tag):]

    def flush(self) -> list[tuple[bool, str | None]]:
        held, self._held = self._held, ""
        return [(self.inside, held)] if held else []


class ThinkParser:
    """`<think>...</think>` is reasoning; the rest is content."""

    def __init__(self) -> None:
        self._split = TagSplitter("<think>", "</think>")

    def feed(self, piece: Piece, final: bool = False) -> Piece:
        out = Piece(reasoning=piece.reasoning, tool_calls=piece.tool_calls)
        segments = self._split.feed(piece.content) + (self._split.flush() if final else [])
        for inside, text in segments:
            if text:
                if inside:
                    out.reasoning += text
                else:
                    out.content += text
        return out


# A call in the usual order, up to the first character of its arguments object: from there they stream.
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=[^\s"])')
_WRAPPER_END = re.compile(r"\s*\}?\s*\Z")  # what may yet be the closing brace of the call itself


def _wrapper_start(call: str, pos: int) -> int:
    """Where, from `pos`, what may yet be the call's own closing brace begins (the pattern always matches)."""
    match = _WRAPPER_END.search(call, pos)
    return match.start() if match is not None else len(call)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are tool calls; the rest is content.

    A block that starts `{"name": "...", "arguments": ` followed by an object streams: the call's id and
    name as soon as they are known, then its arguments' text as it comes (holding back what may be the
    block's own closing brace). Any other block is read whole when its closing tag arrives: a valid call
    (string arguments too) becomes one delta, anything else is given back as content, tags and all, as is
    a block still open at the end that never got that far.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self._split = TagSplitter("<tool_call>", "</tool_call>")
        self._call = ""  # the open block's text
        self._sent: int | None = None  # streaming: where the block's unsent arguments text starts
        self.num_calls = 0
        self.max_calls = max_calls
        self.done = False  # max_calls calls are closed: the rest of the output is not read

    def feed(self, piece: Piece, final: bool = False) -> Piece:
        out = Piece(reasoning=piece.reasoning, tool_calls=list(piece.tool_calls))
        segments = self._split.feed(piece.content) + (self._split.flush() if final else [])
        for inside, text in segments:
            if self.done:
                break
            if inside and text is not None:
                self._call += text
                self._stream(out)
            elif inside:  # the opening tag
                self._call, self._sent = "", None
            elif text is None:  # the closing tag
                if self._sent is None:
                    self._emit_whole(out)
                self.done = self.max_calls is not None and self.num_calls >= self.max_calls
            else:
                out.content += text
        if final and self._split.inside and self._sent is None and not self.done:  # unclosed: give it back
            out.content += "<tool_call>" + self._call
            self._call = ""
        return out

    def _stream(self, out: Piece) -> None:
        if self._sent is None:
            start = _CALL_START.match(self._call)
            if start is None:
                return
            try:
                name = json.loads(f'"{start.group(1)}"')
            except ValueError:  # a bad escape in the name: read the block whole at its end
                return
            out.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                              function=FunctionCallOut(name=name, arguments="")))
            self.num_calls += 1
            self._sent = start.end()
        end = _wrapper_start(self._call, self._sent)
        if end > self._sent:
            out.tool_calls.append(ToolCallOut(index=self.num_calls - 1,
                                              function=FunctionCallOut(arguments=self._call[self._sent:end])))
            self._sent = end

    def _emit_whole(self, out: Piece) -> None:
        try:
            call = json.loads(self._call)
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            out.content += f"<tool_call>{self._call}</tool_call>"
            return
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                          function=FunctionCallOut(name=name, arguments=arguments)))
        self.num_calls += 1


TEXT_PARSERS = {"think": ThinkParser, "hermes": HermesParser}
