"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, their arguments streamed."""
from __future__ import annotations

import json
import re

from sluice.postproc.parsers.base import Piece, TagSplitter, ToolParser, new_call_id
from sluice.schemas.openai import FunctionCallOut, ToolCallOut

# A call in the usual order, up to the first character of its arguments object: from there they stream.
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=[^\s"])')
_WRAPPER_END = re.compile(r"\s*\}?\s*\Z")  # what may yet be the closing brace of the call itself


def _wrapper_start(call: str, pos: int) -> int:
    """Where, from `pos`, what may yet be the call's own closing brace begins (the pattern always matches)."""
    match = _WRAPPER_END.search(call, pos)
    return match.start() if match is not None else len(call)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are tool calls; the rest is content.

    A block that starts `{"name": "...", "arguments": ` followed by an object streams: the call's id and
    name as soon as they are known, then its arguments' text as it comes (holding back what may be the
    block's own closing brace). Any other block is read whole when its closing tag arrives: a valid call
    (string arguments too) becomes one delta, anything else is given back as content, tags and all, as is
    a block still open at the end that never got that far.
    """

    def __init__(self, max_calls: int | None = None, param_types: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__(max_calls, param_types)
        self._split = TagSplitter("<tool_call>", "</tool_call>")
        self._call = ""  # the open block's text
        self._sent: int | None = None  # streaming: where the block's unsent arguments text starts

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

