"""Token-level parsing of gpt-oss output with openai-harmony's StreamableParser.

`analysis` is reasoning, `final` (and commentary without a recipient) is
content, and a `commentary` message to `functions.NAME` is a tool call: its id
and name in the first delta, then its arguments as they stream.
"""
from __future__ import annotations

from typing import Sequence

from openai_harmony import HarmonyError, Role, StreamableParser

from ipc.openai import FunctionCallOut, ToolCallOut
from postproc.parsers import Piece, new_call_id

_FUNCTIONS = "functions."
_MESSAGE_ENDS = frozenset({200007, 200012, 200002})  # <|end|>, <|call|>, <|return|>


class HarmonyParser:
    def __init__(self, encoding, prefix: Sequence[int] = ()) -> None:
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self.num_calls = 0
        self.failed = False
        self._open: int | None = None  # index of the message (tool call) being streamed
        self._done = 0  # messages completed so far (parser.messages is rebuilt on every access: not per token)
        for token in prefix:  # a forced start (tool_choice naming a function) is already in the prompt
            self._parser.process(token)

    def feed(self, token: int) -> Piece:
        piece = Piece()
        if self.failed:
            return piece
        try:
            self._parser.process(token)
        except HarmonyError:  # malformed output: keep what was parsed, stop here
            self.failed = True
            return piece
        p = self._parser
        delta = p.last_content_delta
        if delta:
            recipient = p.current_recipient or ""
            if recipient.startswith(_FUNCTIONS):
                self._call_delta(piece, self._done, recipient, delta)
            elif p.current_channel == "analysis":
                piece.reasoning = delta
            else:
                piece.content = delta
        if token in _MESSAGE_ENDS:
            messages = p.messages
            for i in range(self._done, len(messages)):  # a call that ended before any argument text
                recipient = messages[i].recipient or ""
                if recipient.startswith(_FUNCTIONS) and self._open != i:
                    self._call_delta(piece, i, recipient, "")
            self._done = len(messages)
        return piece

    def _call_delta(self, piece: Piece, message: int, recipient: str, arguments: str) -> None:
        if self._open != message:
            self._open = message
            piece.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                                function=FunctionCallOut(name=recipient[len(_FUNCTIONS):],
                                                                         arguments=arguments)))
            self.num_calls += 1
        else:
            piece.tool_calls.append(ToolCallOut(index=self.num_calls - 1,
                                                function=FunctionCallOut(arguments=arguments)))
