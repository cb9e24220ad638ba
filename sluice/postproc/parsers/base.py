"""What every chat output parser shares: the Piece it passes on, the splitter that holds back a tag's first
characters, and the base of the tool-call parsers."""
from __future__ import annotations

import uuid

import msgspec

from sluice.schemas.openai import FunctionCallOut, ToolCallOut


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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TagSplitter:
    """Splits streamed text into (inside, text) segments around open/close tags; a tag is (inside, None)."""

    def __init__(self, open_tag: str, close_tag: str, inside: bool = False) -> None:
        self.tags = (open_tag, close_tag)
        self.inside = inside
        self._held = ""

    def feed(self, text: str) -> list[tuple[bool, str | None]]:
        buf, out = self._held + text, list[tuple[bool, str | None]]()
        while True:
            tag = self.tags[self.inside]
            i = buf.find(tag)
            if i < 0:
                keep = partial_suffix(buf, tag)
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


class ToolParser:
    """A tool-call parser: counts its calls, and is `done` once `max_calls` of them are closed (the rest of
    the output is then not read). `param_types`: each function's parameters' JSON-schema types, for the
    formats whose arguments are not JSON."""

    def __init__(self, max_calls: int | None = None, param_types: dict[str, dict[str, str]] | None = None) -> None:
        self.num_calls = 0
        self.max_calls = max_calls
        self.param_types = param_types or {}
        self.done = False

    def feed(self, piece: Piece, final: bool = False) -> Piece:
        raise NotImplementedError

    def _emit(self, out: Piece, name: str, arguments: str) -> None:
        """One whole call as one delta."""
        out.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                          function=FunctionCallOut(name=name, arguments=arguments)))
        self.num_calls += 1
        self.done = self.max_calls is not None and self.num_calls >= self.max_calls
