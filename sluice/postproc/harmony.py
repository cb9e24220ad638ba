"""Token-level parsing of gpt-oss output in harmony.

`analysis` is reasoning, `final` (and commentary without a recipient) is
content, and a `commentary` message to `functions.NAME` is a tool call: its id
and name in the first delta, then its arguments as they stream.

The messages' framing (<|start|>, the header, <|message|>, the content, a stop
token) is followed here as openai-harmony's StreamableParser follows it
(strict), and each distinct header is parsed once by a StreamableParser, its
result kept: the parser re-encodes its formatting tokens on every token it
reads outside a message's content, and a model's headers repeat. A message's
content tokens are decoded as the parser decodes them (the same deltas, the
same replacement of invalid UTF-8), without its per-token cost (it re-encodes
every delta to keep the message's text, which nobody here reads).
"""
from __future__ import annotations

from typing import Literal, Sequence

from openai_harmony import HarmonyError, Role, StreamableParser

from sluice.postproc.parsers import Piece, new_call_id
from sluice.schemas.openai import FunctionCallOut, ToolCallOut

_FUNCTIONS = "functions."
_CUT_SHORT = "unexpected end of data"  # a UTF-8 character whose next bytes come with the next token
_MAX_HEADERS = 4096  # distinct headers kept per encoding (a misbehaving model could make any number)

Header = tuple[str, str | None]  # (recipient, channel)
Kind = Literal["reasoning", "content", "call"]


class _Vocab:
    """An encoding's token bytes and texts (cached as they are met), its framing tokens, its parsed headers."""

    _loaded: dict[str, "_Vocab"] = {}

    def __init__(self, encoding) -> None:
        self._encoding = encoding
        self._inner = encoding._inner
        self.start, self.message = (encoding.encode(t, allowed_special="all")[0] for t in ("<|start|>", "<|message|>"))
        self.stops = frozenset(encoding.stop_tokens())
        self._bytes: dict[int, bytes] = {}
        self.texts: dict[int, str] = {}  # the text of each token met whose bytes are whole characters
        self._headers: dict[tuple[bool, tuple[int, ...]], Header | None] = {}

    @classmethod
    def of(cls, encoding) -> "_Vocab":
        vocab = cls._loaded.get(encoding.name)
        if vocab is None:
            vocab = cls._loaded[encoding.name] = cls(encoding)
        return vocab

    def bytes_of(self, tokens: list[int]) -> bytes:
        """Raises HarmonyError for an id outside the vocabulary, as the parser's decoding does."""
        out = []
        for token in tokens:
            if (b := self._bytes.get(token)) is None:
                b = self._bytes[token] = self._inner.decode_bytes([token])
                try:
                    self.texts[token] = b.decode()
                except UnicodeDecodeError:
                    pass
            out.append(b)
        return b"".join(out)

    def header(self, first: bool, tokens: tuple[int, ...]) -> Header | None:
        """A header's (recipient, channel), as the parser reads it; None when it raises. `tokens`: between
        <|start|> and <|message|>; `first`: the output's first message, whose role (the assistant) is given."""
        key = (first, tokens)
        if key not in self._headers:
            parser = StreamableParser(self._encoding, role=Role.ASSISTANT if first else None)
            parsed: Header | None
            try:
                for token in (() if first else (self.start,)) + tokens + (self.message,):
                    parser.process(token)
                parsed = (parser.current_recipient or "", parser.current_channel)
            except HarmonyError:
                parsed = None
            if len(self._headers) >= _MAX_HEADERS:
                self._headers.clear()
            self._headers[key] = parsed
        return self._headers[key]


class HarmonyParser:
    def __init__(self, encoding, prefix: Sequence[int] = ()) -> None:
        self._vocab = _Vocab.of(encoding)
        self.num_calls = 0
        self.failed = False
        self._open: int | None = None  # index of the message (tool call) being streamed
        self._done = 0  # messages ended so far
        self._first = True  # no header parsed yet: the first message's role is given
        self._header: list[int] | None = []  # the header being read; None between messages or in a content
        self._kind: Kind | None = None  # what the message in its content is; None outside a content
        self._recipient = ""  # of the message in its content
        self._undecoded: list[int] = []  # content tokens that do not decode (yet)
        self._bytes = b""  # decoded content bytes that are not whole characters yet
        for token in prefix:  # a forced start (tool_choice naming a function) is already in the prompt
            self.feed(token)

    def feed(self, token: int) -> Piece:
        """What one token adds to the message (nothing once the output turned out malformed)."""
        piece = Piece()
        kind = self._kind
        if kind is None:
            self._frame(token)
        elif token in self._vocab.stops:
            self._end(piece)
        elif delta := self._decode(token):
            if kind == "reasoning":
                piece.reasoning = delta
            elif kind == "content":
                piece.content = delta
            else:
                self._call_delta(piece, self._done, delta)
        return piece

    def plain_text(self, token: int) -> tuple[str, bool] | None:
        """For a token that adds text to a reasoning or content message and changes nothing else (no partial
        character waiting, whole characters of its own, not a stop token): its text and whether it is
        reasoning, what `feed` gives for it; None for any other token (feed that one)."""
        kind = self._kind
        if kind is None or kind == "call" or self._bytes or self._undecoded or token in self._vocab.stops:
            return None
        text = self._vocab.texts.get(token)
        return (text, kind == "reasoning") if text else None

    def _frame(self, token: int) -> None:
        """A token outside a message's content: <|start|> opens a message, then its header up to <|message|>.
        Anything else between messages is malformed output: keep what was parsed, stop here."""
        if self.failed:
            return
        vocab = self._vocab
        if self._header is None:
            if token == vocab.start:
                self._header = []
            else:
                self.failed = True
        elif token != vocab.message:
            self._header.append(token)
        elif (header := vocab.header(self._first, tuple(self._header))) is None:
            self.failed = True
        else:
            self._first, self._header = False, None
            self._recipient, channel = header
            self._kind = ("call" if self._recipient.startswith(_FUNCTIONS) else
                          "reasoning" if channel == "analysis" else "content")

    def _end(self, piece: Piece) -> None:
        """A stop token ends the message: what did not decode is dropped; a call that ended before any
        argument text still shows."""
        if self._kind == "call" and self._open != self._done:
            self._call_delta(piece, self._done, "")
        self._done += 1
        self._kind = None
        self._bytes = b""
        self._undecoded.clear()

    def _decode(self, token: int) -> str | None:
        """A content token's text, as the parser decodes it: bytes held until they make whole characters,
        an invalid sequence replaced by U+FFFD (one per token, the bytes after it left for the next)."""
        if not self._bytes and not self._undecoded and (text := self._vocab.texts.get(token)):
            return text
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

    def _call_delta(self, piece: Piece, message: int, arguments: str) -> None:
        if self._open != message:
            self._open = message
            piece.tool_calls.append(ToolCallOut(index=self.num_calls, id=new_call_id(), type="function",
                                                function=FunctionCallOut(name=self._recipient[len(_FUNCTIONS):],
                                                                         arguments=arguments)))
            self.num_calls += 1
        else:
            piece.tool_calls.append(ToolCallOut(index=self.num_calls - 1,
                                                function=FunctionCallOut(arguments=arguments)))
