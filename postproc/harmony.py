"""Token-level parsing of gpt-oss output with openai-harmony's StreamableParser.

`analysis` is reasoning, `final` (and commentary without a recipient) is
content, and a `commentary` message to `functions.NAME` is a tool call: its id
and name in the first delta, then its arguments as they stream.

The parser reads the headers and ends the messages; a message's content tokens
are decoded here, as the parser decodes them (the same deltas, the same
replacement of invalid UTF-8), without the parser's per-token cost (it
re-encodes every delta to keep the message's text, which nobody here reads).
"""
from __future__ import annotations

from typing import Sequence

from openai_harmony import HarmonyError, Role, StreamableParser

from ipc.openai import FunctionCallOut, ToolCallOut
from postproc.parsers import Piece, new_call_id

_FUNCTIONS = "functions."
_MESSAGE_ENDS = frozenset({200007, 200012, 200002})  # <|end|>, <|call|>, <|return|>
_CUT_SHORT = "unexpected end of data"  # a UTF-8 character whose next bytes come with the next token


class _Vocab:
    """An encoding's token bytes (cached as they are met), its <|message|> token and its stop tokens."""

    _loaded: dict[str, "_Vocab"] = {}

    def __init__(self, encoding) -> None:
        self._inner = encoding._inner
        self.message = encoding.encode("<|message|>", allowed_special="all")[0]
        self.stops = frozenset(encoding.stop_tokens())
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def of(cls, encoding) -> "_Vocab":
        vocab = cls._loaded.get(encoding.name)
        if vocab is None:
            vocab = cls._loaded[encoding.name] = cls(encoding)
        return vocab

    def bytes_of(self, tokens: list[int]) -> bytes:
        """Raises HarmonyError for an id outside the vocabulary, as the parser's decoding does."""
        if len(tokens) == 1 and (known := self._bytes.get(tokens[0])) is not None:
            return known
        out = []
        for token in tokens:
            if (b := self._bytes.get(token)) is None:
                b = self._bytes[token] = self._inner.decode_bytes([token])
            out.append(b)
        return b"".join(out)


class HarmonyParser:
    def __init__(self, encoding, prefix: Sequence[int] = ()) -> None:
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self._vocab = _Vocab.of(encoding)
        self.num_calls = 0
        self.failed = False
        self._open: int | None = None  # index of the message (tool call) being streamed
        self._done = 0  # messages completed so far (parser.messages is rebuilt on every access: not per token)
        self._content: tuple[str, str | None] | None = None  # (recipient, channel) of the message in its content
        self._undecoded: list[int] = []  # content tokens that do not decode (yet)
        self._bytes = b""  # decoded content bytes that are not whole characters yet
        for token in prefix:  # a forced start (tool_choice naming a function) is already in the prompt
            self._process(token)

    def feed(self, token: int) -> Piece:
        piece = Piece()
        if self.failed:
            return piece
        try:
            delta = self._process(token)
        except HarmonyError:  # malformed output: keep what was parsed, stop here
            self.failed = True
            return piece
        p = self._parser
        if delta:
            recipient, channel = self._content or (p.current_recipient or "", p.current_channel)
            if recipient.startswith(_FUNCTIONS):
                self._call_delta(piece, self._done, recipient, delta)
            elif channel == "analysis":
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

    def _process(self, token: int) -> str | None:
        """Feeds one token; returns the content it adds (the parser's last_content_delta)."""
        p = self._parser
        if self._content is None:
            p.process(token)
            if token == self._vocab.message:  # the header parsed (or it raised): the content follows
                self._content = (p.current_recipient or "", p.current_channel)
            return p.last_content_delta
        if token in self._vocab.stops:  # the message ends: the parser closes it, what did not decode is dropped
            self._content, self._bytes = None, b""
            self._undecoded.clear()
            p.process(token)
            return p.last_content_delta
        return self._decode(token)

    def _decode(self, token: int) -> str | None:
        """A content token's text, as the parser decodes it: bytes held until they make whole characters,
        an invalid sequence replaced by U+FFFD (one per token, the bytes after it left for the next)."""
        self._undecoded.append(token)
        try:
            data = self._vocab.bytes_of(self._undecoded)
        except HarmonyError:  # an id outside the vocabulary: nothing more of this message decodes
            return None
        self._undecoded.clear()
        buf = self._bytes + data if self._bytes else data
        try:
            text = buf.decode()
        except UnicodeDecodeError as e:
            valid = buf[: e.start].decode()
            if e.reason == _CUT_SHORT:
                self._bytes = buf[e.start:]
                return valid or None
            self._bytes = buf[e.end:]
            return valid + "\ufffd"
        self._bytes = b""
        return text

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
