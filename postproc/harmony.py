"""Token-level parsing of gpt-oss output with openai-harmony's StreamableParser.

`analysis` is reasoning, `final` (and commentary without a recipient) is
content, and a `commentary` message to `functions.NAME` is a tool call: its id
and name in the first delta, then its arguments as they stream.
"""
from __future__ import annotations

from openai_harmony import HarmonyError, Role, StreamableParser

from ipc.openai import FunctionCallOut, ToolCallOut
from postproc.parsers import Piece, new_call_id

_FUNCTIONS = "functions."


class HarmonyParser:
    def __init__(self, encoding, prefix: list[int] = ()) -> None:
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self.num_calls = 0
        self.failed = False
        self._open: int | None = None  # index (in the parser's messages) of the tool call being streamed
        self._seen = 0
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
                self._call_delta(piece, len(p.messages), recipient, delta)
            elif p.current_channel == "analysis":
                piece.reasoning = delta
            else:
                piece.content = delta
        for i in range(self._seen, len(p.messages)):  # a call that ended before any argument text
            recipient = p.messages[i].recipient or ""
            if recipient.startswith(_FUNCTIONS) and self._open != i:
                self._call_delta(piece, i, recipient, "")
        self._seen = len(p.messages)
        return piece

    def _call_delta(self, piece: Piece, message: int, recipient: str, arguments: str) -> None:
        if self._open != message:
            self._open = message
            piece.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                                function=FunctionCallOut(name=recipient[len(_FUNCTIONS):],
                                                                         arguments=arguments)))
            self.num_calls += 1
        else:
            piece.tool_calls.append(ToolCallOut(index=self.num_calls - 1, function=FunctionCallOut(arguments=arguments)))
