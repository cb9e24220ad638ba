"""Anthropic Messages output for one request: the stream's events, or the whole message.

The message's content blocks are the assembly's items (sluice.postproc.assembly), one block an item; a stream
tells them as they are built, so it assembles into the whole message however the tokens fell into frames.
A frame's text for one block goes in one delta. A tool call's argument text waits until the call ends:
clients parse every input_json_delta as the start of a JSON object (the SDK raises where it cannot be
one), and only the whole call says whether it is; it goes out in one delta, and an input that is not a
JSON object is sent as {}.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import msgspec

from sluice.ipc.messages import PostprocSpec
from sluice.postproc.assembly import Item
from sluice.postproc.framers import FRAMERS, ItemFramer
from sluice.postproc.parsers import Piece
from sluice.schemas.anthropic import Framing, Message, OutputBlock, TextBlock, ThinkingBlock, ToolUseBlock, Usage
from sluice.schemas.openai import PerfMetrics

_json = msgspec.json.Encoder()
_framing = msgspec.msgpack.Decoder(Framing)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "error": "end_turn"}
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def event(name: str, data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


def signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's proves the text is its own; here it names the text (a
    digest), so clients that hand thinking back only with a signature have one."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _block(item: Item) -> OutputBlock:
    if item.kind == "tool_call":
        return ToolUseBlock(item.call_id, item.name, {})
    return TextBlock("") if item.kind == "text" else ThinkingBlock("", "")


class AnthropicFramer(ItemFramer):
    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int,
                 text_of: Callable[[int], str]) -> None:
        super().__init__()
        self.spec = spec
        self.framing = _framing.decode(spec.dialect) if spec.dialect else Framing()
        self.omit_thinking = self.framing.omit_thinking
        self.content: list[OutputBlock] = []  # the assembly's items as blocks
        self.input_tokens = num_prompt_tokens - num_cached_tokens  # Anthropic's: those not read from a cache
        self.cached_tokens = num_cached_tokens
        self.stop_sequence: str | None = None  # the stop string that ended the output
        self._events: list[bytes] = []  # streaming: what the next frame sends
        self._unsent = ""  # streaming: the open block's text not yet in a delta
        self._began = False

    def stopped_by(self, index: int, stop: str) -> None:
        self.stop_sequence = stop

    @property
    def stop_reason(self) -> str:
        if self.finish_reason == "stop" and self.stop_sequence is not None:
            return "stop_sequence"
        if self.finish_reason == "tool_calls" and not any(isinstance(b, ToolUseBlock) for b in self.content):
            return "end_turn"  # (its calls were all malformed)
        return STOP_REASONS.get(self.finish_reason or "stop", "end_turn")

    def usage(self, output_tokens: int) -> Usage:
        return Usage(self.input_tokens, 0, self.cached_tokens, output_tokens)

    def message(self, content: list[OutputBlock], output_tokens: int, done: bool) -> Message:
        reason = self.stop_reason if done else None
        return Message(id=self.spec.request_id, content=content, model=self.spec.model, stop_reason=reason,
                       stop_sequence=self.stop_sequence if reason == "stop_sequence" else None,
                       usage=self.usage(output_tokens), diagnostics=self.framing.diagnostics,
                       context_management=self.framing.context_management if done else None)

    # ---- streaming (the pieces come token by token through `add`) -------------------------------------

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        head = b""
        if not self._began:
            self._began = True
            head = event("message_start", {"type": "message_start", "message": self.message([], 0, False)})
        return head + self._take()

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        self.assembly.finish()
        reason = self.stop_reason
        delta = {"type": "message_delta", "usage": self.usage(completion_tokens),
                 "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence
                           if reason == "stop_sequence" else None}}
        if self.framing.context_management is not None:  # (what the request's edits cleared: said at the end)
            delta["context_management"] = self.framing.context_management
        self.closing = len(MESSAGE_STOP)
        return self._take() + event("message_delta", delta) + MESSAGE_STOP

    def _take(self) -> bytes:
        """The events of the pieces added since the last take."""
        self._flush()
        out, self._events = b"".join(self._events), []
        return out

    # ---- a whole body ------------------------------------------------------------------------------

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        self.assembly.finish()
        return _json.encode(self.message(self.content, completion_tokens, True))

    # ---- the assembly's events: blocks -------------------------------------------------------------

    def opened(self, index: int, item: Item) -> None:
        block = _block(item)
        self.content.append(block)
        self._event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    def added(self, index: int, item: Item, text: str) -> None:
        block = self.content[index]
        if isinstance(block, TextBlock):
            block.text += text
        elif isinstance(block, ThinkingBlock) and not self.omit_thinking:
            block.thinking += text
        else:
            return  # (a call's arguments wait for its end)
        self._unsent += text

    def closed(self, index: int, item: Item) -> None:
        self._flush()
        block = self.content[index]
        if isinstance(block, ThinkingBlock):
            block.signature = signature(block.thinking)
            self._delta({"type": "signature_delta", "signature": block.signature})
        elif isinstance(block, ToolUseBlock):
            block.input = tool_input(item.text)
            self._delta({"type": "input_json_delta", "partial_json": _json.encode(block.input).decode()})
        self._event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _flush(self) -> None:
        """The open block's unsent text, as one delta."""
        if self._unsent:
            kind = "text" if isinstance(self.content[-1], TextBlock) else "thinking"
            self._delta({"type": f"{kind}_delta", kind: self._unsent})
            self._unsent = ""

    def _delta(self, delta: dict) -> None:
        self._event("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                            "delta": delta})

    def _event(self, name: str, data: dict) -> None:
        if self.spec.stream:
            self._events.append(event(name, data))


FRAMERS["messages"] = AnthropicFramer
