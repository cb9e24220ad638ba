"""Reasoning parsers: `<think>...</think>` is reasoning, the rest is content."""
from __future__ import annotations

from sluice.postproc.parsers.base import Piece, TagSplitter


class ThinkParser:
    """`<think>...</think>` is reasoning; the rest is content (`think`, and `qwen3`: a Qwen3 model that does not
    think writes no tags, and one whose template opened `<think>` has it read first from the prompt)."""

    def __init__(self, inside: bool = False) -> None:
        self._split = TagSplitter("<think>", "</think>", inside)

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


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1: the output starts in reasoning whether or not it writes `<think>` (its template opens the
    block in the prompt), so everything before `</think>` is reasoning, all of it when there is none. A
    `<think>` that the model writes first anyway is not part of the reasoning."""

    def __init__(self) -> None:
        super().__init__(inside=True)
        self._head: str | None = ""  # the output's start while it may yet be a `<think>` of its own (None: past)

    def feed(self, piece: Piece, final: bool = False) -> Piece:
        if self._head is not None:
            head = self._head + piece.content
            text = head.lstrip()
            if text.startswith("<think>"):
                piece, self._head = Piece(text[len("<think>"):], piece.reasoning, piece.tool_calls), None
            elif "<think>".startswith(text) and not final:
                self._head = head
                return Piece(reasoning=piece.reasoning, tool_calls=piece.tool_calls)
            else:
                piece, self._head = Piece(head, piece.reasoning, piece.tool_calls), None
        return super().feed(piece, final)
