"""Responses API output for one request: its stream events (SSE) or its whole response.

The message pieces become output items: reasoning -> a `reasoning` item, content -> a `message` with one
`output_text` part, each tool call -> a `function_call` item. A stream and a whole body go through the same
Output, so the stream assembles into the very response the body would be.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ipc.messages import PostprocSpec
from ipc.openai import PerfMetrics, ToolCallOut
from ipc.responses import (Event, FramerSpec, FunctionCallItem, IncompleteDetails, InputTokensDetails, ItemEvent,
                           ItemStatus, MessageItem, OutputItem, OutputText, OutputTokensDetails, PartEvent,
                           ReasoningItem, ReasoningText, Response, ResponseError, ResponseEvent, TextEvent, Usage, sse)
from postproc.framers import FRAMERS
from postproc.parsers import Piece

_json = msgspec.json.Encoder()
_spec_decoder = msgspec.msgpack.Decoder(FramerSpec)
Kind = Literal["reasoning", "message", "function_call"]
_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


def new_item_id(kind: Kind) -> str:
    return _PREFIX[kind] + uuid.uuid4().hex


@dataclass
class _Open:
    """The item being written: where it is, and its text (or arguments) so far."""

    kind: Kind
    index: int  # in the output
    id: str
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class Output:
    """A response's output items, built from message pieces, and the stream events that tell how (numbered
    on from `sequence_number`; kept only when `emit`).

    A piece does not say in which order its parts came: they are read as reasoning, then content, then tool
    calls, the order a model writes them in. So that any grouping of the same tokens into pieces gives the
    same items, an item's text begins with no whitespace and ends with none unless the item ends the output
    (whitespace waits for text to follow it): a newline between two tool calls makes no message."""

    def __init__(self, sequence_number: int = 0, emit: bool = True) -> None:
        self.items: list[OutputItem] = []
        self.sequence_number = sequence_number
        self.emit = emit
        self.events: list[Event] = []
        self._open: _Open | None = None
        self._calls: dict[int, _Open] = {}  # a parser's call index -> its item
        self._held: tuple[Kind, str] = ("message", "")  # whitespace that waits for text of its kind

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def feed(self, piece: Piece) -> None:
        if piece.reasoning:
            self._text("reasoning", piece.reasoning)
        if piece.content:
            self._text("message", piece.content)
        for delta in piece.tool_calls:
            self._call(delta)

    def close(self, status: ItemStatus = "completed", last: bool = False) -> None:
        """Ends the item being written (the output ends, or another item begins)."""
        item = self._open
        if item is None:
            return
        if last and self._held[0] == item.kind and self._held[1]:
            self._delta(self._held[1])
        self._open = None
        text = "".join(item.parts)
        done: OutputItem
        if item.kind == "function_call":
            self._event(TextEvent, type="response.function_call_arguments.done", item_id=item.id,
                        output_index=item.index, arguments=text)
            done = FunctionCallItem(id=item.id, status=status, call_id=item.call_id, name=item.name, arguments=text)
        else:
            part = self._part(item.kind, text)
            self._event(TextEvent, type=f"response.{part.type}.done", item_id=item.id, output_index=item.index,
                        content_index=0, text=text, **_logprobs(item.kind))
            self._event(PartEvent, type="response.content_part.done", item_id=item.id, output_index=item.index,
                        content_index=0, part=part)
            done = self._item(item, status, [part])
        self.items[item.index] = done
        self._event(ItemEvent, type="response.output_item.done", output_index=item.index, item=done)

    # ---- pieces ----------------------------------------------------------------

    def _text(self, kind: Kind, text: str) -> None:
        if self._held[0] == kind:
            text = self._held[1] + text
        body = text.rstrip()
        if not body:
            self._held = (kind, text)
            return
        trailing = text[len(body):]
        if self._open is None or self._open.kind != kind:
            self._begin(kind)
            body = body.lstrip()
        self._held = (kind, trailing)
        self._delta(body)

    def _delta(self, text: str) -> None:
        item = self._open
        assert item is not None
        item.parts.append(text)
        self._event(TextEvent, type=f"response.{_part_type(item.kind)}.delta", item_id=item.id,
                    output_index=item.index, content_index=0, delta=text, **_logprobs(item.kind))

    def _call(self, delta: ToolCallOut) -> None:
        index, fn = delta.index or 0, delta.function
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = self._begin("function_call", delta.id or "", fn and fn.name or "")
        arguments = fn.arguments if fn is not None else None
        if arguments:
            call.parts.append(arguments)
            self._event(TextEvent, type="response.function_call_arguments.delta", item_id=call.id,
                        output_index=call.index, delta=arguments)

    def _begin(self, kind: Kind, call_id: str = "", name: str = "") -> _Open:
        self.close()
        self._held = (kind, "")
        item = self._open = _Open(kind, len(self.items), new_item_id(kind), call_id=call_id, name=name)
        added = self._item(item, "in_progress", [])
        self.items.append(added)
        self._event(ItemEvent, type="response.output_item.added", output_index=item.index, item=added)
        if kind != "function_call":
            self._event(PartEvent, type="response.content_part.added", item_id=item.id, output_index=item.index,
                        content_index=0, part=self._part(kind, ""))
        return item

    @staticmethod
    def _part(kind: Kind, text: str) -> OutputText | ReasoningText:
        return ReasoningText(text=text) if kind == "reasoning" else OutputText(text=text)

    @staticmethod
    def _item(item: _Open, status: ItemStatus, parts: list) -> OutputItem:
        if item.kind == "reasoning":
            return ReasoningItem(id=item.id, status=status, content=parts)
        if item.kind == "message":
            return MessageItem(id=item.id, status=status, content=parts)
        return FunctionCallItem(id=item.id, status=status, call_id=item.call_id, name=item.name,
                                arguments="".join(item.parts))

    def _event(self, cls: type, **fields) -> None:
        if self.emit:
            self.events.append(cls(sequence_number=self.sequence_number, **fields))
        self.sequence_number += 1


def _part_type(kind: Kind) -> str:
    return "reasoning_text" if kind == "reasoning" else "output_text"


def _logprobs(kind: Kind) -> dict:
    return {} if kind == "reasoning" else {"logprobs": []}


class ResponsesFramer:
    """One request's Output, told as events (a stream) or returned whole (a body)."""

    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of) -> None:
        framing = _spec_decoder.decode(spec.dialect)
        self.response = framing.response
        self.response.id = spec.request_id
        self.response.created_at = self.response.created_at or spec.created
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.reasoning_tokens = 0  # told by the request before end / body
        self.output = Output(framing.first_sequence_number, emit=spec.stream)
        self.resumed = framing.first_sequence_number > 0  # the background owner stored response.created
        self.finish_reason: str | None = None
        self._opened = False

    # ---- streaming -------------------------------------------------------------

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list, token_ids: list[int],
              completion_tokens: int = 0) -> bytes:
        out = b""
        if not self._opened:
            self._opened = True
            out = self._opening()
        self.add(index, piece, logprobs, token_ids, finish_reason)
        return out + b"".join(sse(e) for e in self.output.take())

    def _opening(self) -> bytes:
        """response.created (unless stored when the response was queued), then response.in_progress."""
        out = b""
        for kind in ("in_progress",) if self.resumed else ("created", "in_progress"):
            out += sse(ResponseEvent(type=f"response.{kind}", sequence_number=self.output.sequence_number,
                                     response=msgspec.structs.replace(self.response, status="in_progress")))
            self.output.sequence_number += 1
        return out

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        final = self.final(completion_tokens)
        events = b"".join(sse(e) for e in self.output.take())
        last = ResponseEvent(type=f"response.{final.status}", sequence_number=self.output.sequence_number,
                             response=final)
        return events + sse(last)

    # ---- one body --------------------------------------------------------------

    def add(self, index: int, piece: Piece, logprobs: list, token_ids: list[int], finish_reason: str | None) -> None:
        self.output.feed(piece)
        if finish_reason:
            self.finish_reason = finish_reason

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        return _json.encode(self.final(completion_tokens))

    def add_prompt_logprobs(self, start: int, prompt_ids: list[int], entries: list[tuple]) -> None:
        """(The responses translation asks for none.)"""

    # ---- the end ---------------------------------------------------------------

    def final(self, completion_tokens: int) -> Response:
        """The finished response (its open item closed: incomplete when the output was cut at its limit)."""
        r = self.response
        cut = self.finish_reason == "length"
        self.output.close("incomplete" if cut else "completed", last=True)
        r.output = self.output.items
        r.usage = Usage(self.num_prompt_tokens, InputTokensDetails(self.num_cached_tokens), completion_tokens,
                        OutputTokensDetails(self.reasoning_tokens), self.num_prompt_tokens + completion_tokens)
        if cut:
            r.status, r.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
        elif self.finish_reason == "error":
            r.status = "failed"
            r.error = ResponseError("server_error", "the model's output could not be parsed; the output holds what "
                                                    "was read before it")
        else:
            r.status = "completed"
        return r


FRAMERS["responses"] = ResponsesFramer
