"""One choice's message as a sequence of items, built from its pieces as they come: the one assembly under
every dialect's framer. Anthropic's content blocks and the Responses API's output items are its items told
as events; an OpenAI chat message is its items joined (content, reasoning, tool calls).

An item is reasoning, text, or a tool call; one is open at a time, and a new one closes it. A piece does
not say in which order its parts came, so they are read in the order of a turn: the open call's argument
text (a call's deltas are contiguous), reasoning, text, then new calls.

Whitespace (`trim`, the itemised dialects): an item's text begins with none, and its trailing whitespace
waits until more text of that item follows; the output's last item keeps what waited. So whitespace between
items (hermes puts newlines between and after its calls, a template puts them after its reasoning) makes
no item of its own, and any grouping of the same tokens into pieces gives the same items. Without `trim`
(OpenAI's one content string, whose stream sends every character as it comes) the text is kept verbatim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.postproc.parsers import Piece
from sluice.schemas.openai import ToolCallOut

Kind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Item:
    kind: Kind
    text: str = ""  # the text, or a call's argument text
    call_id: str = ""
    name: str = ""


class Events:
    """What a framer that tells the assembly as it goes implements: an item opened, text added to the open
    item, the open item closed (its text whole). Every call names the item's place in the output."""

    def opened(self, index: int, item: Item) -> None:
        pass

    def added(self, index: int, item: Item, text: str) -> None:
        pass

    def closed(self, index: int, item: Item) -> None:
        pass


class Assembly:
    def __init__(self, events: Events | None = None, trim: bool = True) -> None:
        self.items: list[Item] = []
        self.events = events or Events()
        self.trim = trim
        self._open: Item | None = None
        self._call: int | None = None  # the open call's index (the parser's)
        self._held = ""  # the open item's trailing whitespace, waiting for more of its text

    def feed(self, piece: Piece) -> None:
        calls, n = piece.tool_calls, 0
        while n < len(calls) and self._continues(calls[n]):
            self._add(_arguments(calls[n]))
            n += 1
        if piece.reasoning:
            self._text("reasoning", piece.reasoning)
        if piece.content:
            self._text("text", piece.content)
        for call in calls[n:]:
            if call.id is not None:
                name = call.function.name if call.function is not None else None
                self._begin(Item("tool_call", call_id=call.id, name=name or ""))
                self._call = call.index
                self._add(_arguments(call))
            elif self._continues(call):
                self._add(_arguments(call))

    def finish(self) -> None:
        """The output ended: the open item keeps the whitespace that waited, and closes."""
        if self._held:
            self._add(self._held)
        self._close()

    def _continues(self, call: ToolCallOut) -> bool:
        return self._open is not None and self._open.kind == "tool_call" and call.id is None \
            and call.index == self._call

    def _text(self, kind: Kind, text: str) -> None:
        if not self.trim:
            if self._open is None or self._open.kind != kind:
                self._begin(Item(kind))
            self._add(text)
            return
        continues = self._open is not None and self._open.kind == kind
        if continues:
            text, self._held = self._held + text, ""
        body = text.rstrip()
        if not continues:
            body = body.lstrip()
            if not body:
                return  # whitespace that begins no item
            self._begin(Item(kind))
        self._held = text[len(text.rstrip()):]
        self._add(body)

    def _add(self, text: str) -> None:
        if text:
            item = self._open
            assert item is not None
            item.text += text
            self.events.added(len(self.items) - 1, item, text)

    def _begin(self, item: Item) -> None:
        self._close()
        self.items.append(item)
        self._open = item
        self.events.opened(len(self.items) - 1, item)

    def _close(self) -> None:
        item = self._open
        if item is not None:
            self._open, self._call, self._held = None, None, ""
            self.events.closed(len(self.items) - 1, item)


def _arguments(call: ToolCallOut) -> str:
    return (call.function.arguments or "") if call.function is not None else ""
