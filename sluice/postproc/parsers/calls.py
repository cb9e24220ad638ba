"""Tool-call formats that are read a call at a time: text is content until the format's marker, then a scanner
reads the calls after it (`llama3_json`, `mistral`, `granite`, `deepseek_v3`, `qwen3_coder`, `pythonic`).

A call written name first with an object for its arguments (`{"name": ..., "arguments": {` in the JSON
formats) streams: its id and name as soon as they are read, then its arguments' text as it comes, as the
model wrote it. Any other call goes out whole (name and arguments in one delta) once its text is complete.
The scanner reads the whole region again each time text comes, so what it finds depends only on the text so
far, never on how it was chunked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.base import tool_formats as formats
from sluice.postproc.parsers.base import Piece, ToolParser, new_call_id, partial_suffix
from sluice.postproc.parsers.scanners import (Scanner, scan_deepseek, scan_granite, scan_llama3, scan_mistral,
                                              scan_pythonic, scan_qwen3_coder)
from sluice.schemas.openai import FunctionCallOut, ToolCallOut


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
        self._sent = 0  # calls of the region given out whole
        self._streamed: int | None = None  # of the call streaming: how much of its arguments' text is out

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
        if scan.status == "bad" and not scan.calls and scan.partial is None:
            self._mode = "plain"
            return True
        for name, arguments in scan.calls[self._sent:]:
            self._complete(out, name, arguments)
            if self.done:
                return False
        end = scan.end
        if (partial := scan.partial) is not None:
            end = partial.end
            self._stream(out, partial.name, self._buf[partial.start:end])
            if not final:
                return False
            self._complete(out, partial.name, self._buf[partial.start:end])  # cut short: it ends with the output
            if self.done:
                return False
        elif scan.status == "open" and not final:
            return False
        rest = self._buf[end:]
        if scan.status == "closed":
            self._mode = "start" if self.fmt.at_start else "text"
        else:  # bad after good calls, or cut short: what is left is text, unless it is only the format's punctuation
            self._mode, rest = "plain", rest if rest.strip(" \n\t;,]}`") else ""
        self._buf = rest
        return True

    def _stream(self, out: Piece, name: str, arguments: str) -> None:
        """The streaming call's id and name (the first time), then what is new of its arguments' text."""
        if self._streamed is None:
            out.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                              function=FunctionCallOut(name=name, arguments="")))
            self.num_calls += 1
            self._streamed = 0
        if len(arguments) > self._streamed:
            out.tool_calls.append(ToolCallOut(index=self.num_calls - 1,
                                              function=FunctionCallOut(arguments=arguments[self._streamed:])))
            self._streamed = len(arguments)

    def _complete(self, out: Piece, name: str, arguments: str) -> None:
        """A call of the region is complete: the rest of it, or all of it."""
        self._sent += 1
        if self._streamed is None:
            self._emit(out, name, arguments)
            return
        self._stream(out, name, arguments)
        self._streamed = None
        self.done = self.max_calls is not None and self.num_calls >= self.max_calls



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
