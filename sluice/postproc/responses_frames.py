"""Responses API output for one request: its stream events (SSE) or its whole response.

The output items are the assembly's items (sluice.postproc.assembly): reasoning -> a `reasoning` item, text -> a
`message` with one `output_text` part, each tool call -> a `function_call` item. A stream and a whole body
go through the same assembly, so the stream assembles into the very response the body would be.
"""
from __future__ import annotations

import uuid

import msgspec

from sluice.base import sealing
from sluice.ipc.messages import PostprocSpec
from sluice.postproc.assembly import Item, Kind
from sluice.postproc.framers import FRAMERS, ItemFramer
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import PerfMetrics
from sluice.schemas.responses import (Event, FramerSpec, FunctionCallItem, IncompleteDetails, InputTokensDetails,
                                      ItemEvent, ItemStatus, MessageItem, OutputItem, OutputText, OutputTokensDetails,
                                      PartEvent, ReasoningItem, ReasoningText, Response, ResponseError, ResponseEvent,
                                      TextEvent, Usage, sse)

_json = msgspec.json.Encoder()
_spec_decoder = msgspec.msgpack.Decoder(FramerSpec)
_PREFIX: dict[Kind, str] = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}


def new_item_id(kind: Kind) -> str:
    return _PREFIX[kind] + uuid.uuid4().hex


def _part(item: Item) -> OutputText | ReasoningText:
    return ReasoningText(text=item.text) if item.kind == "reasoning" else OutputText(text=item.text)


def _output_item(item: Item, id: str, status: ItemStatus, parts: list, framing: FramerSpec) -> OutputItem:
    if item.kind == "reasoning":
        return ReasoningItem(id=id, status=status, content=parts)
    if item.kind == "text":
        return MessageItem(id=id, status=status, content=parts)
    if item.name in framing.namespaces:  # a namespace's function: its own name, and the namespace
        namespace, name = framing.namespaces[item.name]
        return FunctionCallItem(id=id, status=status, call_id=item.call_id, name=name, arguments=item.text,
                                namespace=namespace)
    return FunctionCallItem(id=id, status=status, call_id=item.call_id, name=item.name, arguments=item.text)


def _part_type(kind: Kind) -> str:
    return "reasoning_text" if kind == "reasoning" else "output_text"


def _logprobs(kind: Kind) -> dict:
    return {} if kind == "reasoning" else {"logprobs": []}


class ResponsesFramer(ItemFramer):
    """One request's output items, told as events (a stream) or returned whole (a body)."""

    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of) -> None:
        super().__init__()
        framing = self.framing = _spec_decoder.decode(spec.dialect)
        self.response = framing.response
        self.response.id = spec.request_id
        self.response.created_at = self.response.created_at or spec.created
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.items: list[OutputItem] = []
        self.emit = spec.stream
        self.events: list[Event] = []  # streaming: what the next frame sends
        self._sizes: list[int] = []  # the byte length of each event sent since the last take_sizes
        self.sequence_number = framing.first_sequence_number
        self.resumed = framing.first_sequence_number > 0  # the background owner stored response.created
        self._ids: list[str] = []  # each item's id
        self._status: ItemStatus = "completed"  # what the item closed now ends as
        self._opened = False
        self._final: Response | None = None

    # ---- streaming -------------------------------------------------------------

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list, token_ids: list[int],
              completion_tokens: int = 0) -> bytes:
        self._opening()
        return self._take()

    def _opening(self) -> None:
        """response.created (unless stored when the response was queued), then response.in_progress: before
        any other event."""
        if self._opened or not self.emit:
            return
        self._opened = True
        for kind in ("in_progress",) if self.resumed else ("created", "in_progress"):
            self._event(ResponseEvent, type=f"response.{kind}",
                        response=msgspec.structs.replace(self.response, status="in_progress"))

    def _take(self) -> bytes:
        events, self.events = [sse(e) for e in self.events], []
        self._sizes += map(len, events)
        return b"".join(events)

    def take_sizes(self) -> list[int]:
        """Every event's byte length (a stored stream keeps each event, numbered)."""
        sizes, self._sizes = self._sizes, []
        return sizes

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        final = self.final(completion_tokens)
        self._event(ResponseEvent, type=f"response.{final.status}", response=final)
        return self._take()

    # ---- one body --------------------------------------------------------------

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        return _json.encode(self.final(completion_tokens))

    # ---- the end ---------------------------------------------------------------

    def final(self, completion_tokens: int) -> Response:
        """The finished response (its open item closed: incomplete when the output was cut at its limit); the
        same one when asked again (a stored stream's last event and its stored body)."""
        if self._final is not None:
            return self._final
        r = self._final = self.response
        cut = self.finish_reason == "length"
        self._status = "incomplete" if cut else "completed"
        self.assembly.finish()
        r.output = self.items
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

    # ---- the assembly's events: output items --------------------------------------------------------

    def opened(self, index: int, item: Item) -> None:
        self._ids.append(item_id := new_item_id(item.kind))
        added = _output_item(item, item_id, "in_progress", [], self.framing)
        self.items.append(added)
        self._event(ItemEvent, type="response.output_item.added", output_index=index, item=added)
        if item.kind != "tool_call":
            self._event(PartEvent, type="response.content_part.added", item_id=item_id, output_index=index,
                        content_index=0, part=_part(Item(item.kind)))

    def added(self, index: int, item: Item, text: str) -> None:
        if item.kind == "tool_call":
            self._event(TextEvent, type="response.function_call_arguments.delta", item_id=self._ids[index],
                        output_index=index, delta=text)
        else:
            self._event(TextEvent, type=f"response.{_part_type(item.kind)}.delta", item_id=self._ids[index],
                        output_index=index, content_index=0, delta=text, **_logprobs(item.kind))

    def closed(self, index: int, item: Item) -> None:
        item_id, parts = self._ids[index], []
        if item.kind == "tool_call":
            self._event(TextEvent, type="response.function_call_arguments.done", item_id=item_id,
                        output_index=index, arguments=item.text)
        else:
            parts = [part := _part(item)]
            self._event(TextEvent, type=f"response.{part.type}.done", item_id=item_id, output_index=index,
                        content_index=0, text=item.text, **_logprobs(item.kind))
            self._event(PartEvent, type="response.content_part.done", item_id=item_id, output_index=index,
                        content_index=0, part=part)
        done = self.items[index] = _output_item(item, item_id, self._status, parts, self.framing)
        if isinstance(done, ReasoningItem) and self.framing.seal_with:
            done.encrypted_content = sealing.sealer(self.framing.seal_with).seal(item.text)
        self._event(ItemEvent, type="response.output_item.done", output_index=index, item=done)

    def _event(self, cls: type, **fields) -> None:
        if self.emit:
            self._opening()
            self.events.append(cls(sequence_number=self.sequence_number, **fields))
        self.sequence_number += 1


FRAMERS["responses"] = ResponsesFramer
