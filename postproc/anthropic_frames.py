"""Anthropic Messages output for one request: the stream's events, or the whole message.

One assembly (`Blocks`) serves both: each token's piece in, in order (streaming too: a stream's frame merges
its tokens' pieces, which loses the order between reasoning, text and calls), content blocks out, plus
(streaming) the events that build them. A stream and a whole body of the same tokens hold the same message,
however the tokens fell into frames; a frame's text for one block goes in one delta.

Two things are held back. A text's trailing whitespace, until more text follows: hermes leaves newlines
between and after its tool calls, which would otherwise make text blocks of their own (at the end it goes
to a text block still open). And a tool call's argument text, until the call ends: clients parse every
input_json_delta as the start of a JSON object (the SDK raises where it cannot be one), and only the whole
call says whether it is; it goes out in one delta, and an input that is not a JSON object is sent as {}.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import msgspec

from ipc.anthropic import Framing, Message, OutputBlock, TextBlock, ThinkingBlock, ToolUseBlock, Usage
from ipc.messages import PostprocSpec
from ipc.openai import PerfMetrics, ToolCallOut
from postproc.framers import FRAMERS
from postproc.parsers import Piece

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


class Blocks:
    """A message's content blocks as its pieces arrive, and (streaming) the events that build them."""

    def __init__(self, stream: bool, omit_thinking: bool = False) -> None:
        self.stream = stream
        self.omit_thinking = omit_thinking
        self.content: list[OutputBlock] = []
        self._events: list[bytes] = []  # streaming: what the next frame sends
        self._open: type | None = None  # the type of the block still open
        self._unsent = ""  # streaming: the open block's text not yet in a delta
        self._held = ""  # trailing whitespace of the text
        self._call: int | None = None  # the open tool call's index (the parser's)
        self._arguments = ""  # the open tool call's argument text

    def feed(self, piece: Piece) -> None:
        """One token's piece, read in the order of a turn: the open call's argument text (a call's deltas are
        contiguous), reasoning, text, then new calls."""
        calls, n = piece.tool_calls, 0
        while n < len(calls) and self._continues(calls[n]):
            self._arguments += _arguments(calls[n])
            n += 1
        if piece.reasoning and not self.omit_thinking:
            self._append(ThinkingBlock, piece.reasoning)
        elif piece.reasoning and self._open is not ThinkingBlock:
            self._start(ThinkingBlock("", ""))
        if piece.content:
            self._text(piece.content)
        for call in calls[n:]:
            if call.id is not None:
                self._start_call(call)
            elif self._continues(call):
                self._arguments += _arguments(call)

    def finish(self) -> None:
        if self._open is TextBlock and self._held:
            self._append(TextBlock, self._held)
        self._held = ""
        self._close()

    def take(self) -> bytes:
        """The events of the pieces fed since the last take."""
        self._flush()
        out, self._events = b"".join(self._events), []
        return out

    def _continues(self, call: ToolCallOut) -> bool:
        return self._open is ToolUseBlock and call.id is None and call.index == self._call

    def _text(self, text: str) -> None:
        text = self._held + text
        shown = text.rstrip()
        self._held = text[len(shown):]
        if shown:
            self._append(TextBlock, shown)

    def _append(self, kind: type, text: str) -> None:
        if self._open is not kind:
            self._start(TextBlock("") if kind is TextBlock else ThinkingBlock("", ""))
        block = self.content[-1]
        if isinstance(block, TextBlock):
            block.text += text
        elif isinstance(block, ThinkingBlock):
            block.thinking += text
        self._unsent += text

    def _start_call(self, call: ToolCallOut) -> None:
        name = call.function.name if call.function is not None else None
        self._start(ToolUseBlock(call.id or "", name or "", {}))
        self._call, self._arguments = call.index, _arguments(call)

    def _start(self, block: OutputBlock) -> None:
        self._close()
        self.content.append(block)
        self._open = type(block)
        self._event("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                            "content_block": block})

    def _close(self) -> None:
        if self._open is None:
            return
        self._flush()
        block = self.content[-1]
        if isinstance(block, ThinkingBlock):
            block.signature = signature(block.thinking)
            self._delta({"type": "signature_delta", "signature": block.signature})
        elif isinstance(block, ToolUseBlock):
            block.input = tool_input(self._arguments)
            self._delta({"type": "input_json_delta", "partial_json": _json.encode(block.input).decode()})
            self._call, self._arguments = None, ""
        self._event("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})
        self._open = None

    def _flush(self) -> None:
        """The open block's unsent text, as one delta."""
        if self._unsent:
            if self._open is TextBlock:
                self._delta({"type": "text_delta", "text": self._unsent})
            else:
                self._delta({"type": "thinking_delta", "thinking": self._unsent})
            self._unsent = ""

    def _delta(self, delta: dict) -> None:
        self._event("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                            "delta": delta})

    def _event(self, name: str, data: dict) -> None:
        if self.stream:
            self._events.append(event(name, data))


def _arguments(call: ToolCallOut) -> str:
    return (call.function.arguments or "") if call.function is not None else ""


class AnthropicFramer:
    takes_each_piece = True  # (postproc.request.TakesEachPiece)

    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int,
                 text_of: Callable[[int], str]) -> None:
        self.spec = spec
        framing = _framing.decode(spec.dialect) if spec.dialect else Framing()
        self.blocks = Blocks(spec.stream, framing.omit_thinking)
        self.input_tokens = num_prompt_tokens - num_cached_tokens  # Anthropic's: those not read from a cache
        self.cached_tokens = num_cached_tokens
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended the output
        self._began = False

    def stopped_by(self, index: int, stop: str) -> None:
        self.stop_sequence = stop

    @property
    def stop_reason(self) -> str:
        if self.finish_reason == "stop" and self.stop_sequence is not None:
            return "stop_sequence"
        if self.finish_reason == "tool_calls" and not any(isinstance(b, ToolUseBlock) for b in self.blocks.content):
            return "end_turn"  # (its calls were all malformed)
        return STOP_REASONS.get(self.finish_reason or "stop", "end_turn")

    def usage(self, output_tokens: int) -> Usage:
        return Usage(self.input_tokens, 0, self.cached_tokens, output_tokens)

    def message(self, content: list[OutputBlock], output_tokens: int, done: bool) -> Message:
        reason = self.stop_reason if done else None
        return Message(id=self.spec.request_id, content=content, model=self.spec.model, stop_reason=reason,
                       stop_sequence=self.stop_sequence if reason == "stop_sequence" else None,
                       usage=self.usage(output_tokens))

    # ---- streaming: the pieces come token by token through `add` (takes_each_piece) ----

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        head = b""
        if not self._began:
            self._began = True
            head = event("message_start", {"type": "message_start", "message": self.message([], 0, False)})
        return head + self.blocks.take()

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        self.blocks.finish()
        reason = self.stop_reason
        delta = {"type": "message_delta", "usage": self.usage(completion_tokens),
                 "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence
                           if reason == "stop_sequence" else None}}
        return self.blocks.take() + event("message_delta", delta) + MESSAGE_STOP

    # ---- both --------------------------------------------------------------------

    def add(self, index: int, piece: Piece, logprobs: list[tuple[int, tuple]], token_ids: list[int],
            finish_reason: str | None) -> None:
        self.blocks.feed(piece)
        if finish_reason:
            self.finish_reason = finish_reason
            self.blocks.finish()

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        self.blocks.finish()
        return _json.encode(self.message(self.blocks.content, completion_tokens, True))

    def add_prompt_logprobs(self, start: int, prompt_ids: list[int], entries: list[tuple]) -> None:
        pass  # (the dialect has no logprobs: the translation never asks for them)


FRAMERS["messages"] = AnthropicFramer
