"""The dialects' framers: each turns one request's message pieces (content, reasoning, tool-call deltas),
finish reasons and usage into its dialect's stream events or whole body. RequestOutput drives whichever
the request's endpoint names; parsing and detokenizing before them are shared, and so is the assembly of
the pieces into items (sluice.postproc.assembly) for the dialects whose output is a list of items."""
from __future__ import annotations

import importlib
from typing import Callable

from sluice.ipc.messages import Endpoint, PostprocSpec
from sluice.postproc.assembly import Assembly, Events
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import PerfMetrics

TokenText = Callable[[int], str]


class Framer:
    """One request's output in its dialect. Streaming: `chunk` per frame, then `end`; a whole body: `add` per
    token, then `body`. A framer whose `takes_each_piece` gets `add` for every token when streaming too, and
    frames from that (`chunk` gets the pieces since the last frame merged, which keeps each kind's text but
    not the order between kinds)."""

    takes_each_piece = False
    sequence_number = 0  # the number the stream's next event takes (a dialect that numbers its events)
    closing = 0  # the byte length of the closing event that ends `end`'s bytes (set by `end`: Frame.sizes)
    reasoning_tokens = 0  # how many output tokens were reasoning: told before `end` / `body`
    # draft tokens of a predicted output (chat's `prediction`) the output kept, and those it did not: as they come
    accepted_prediction_tokens = 0
    rejected_prediction_tokens = 0

    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        """A stream's bytes for what choice `index` adds now (empty when there is nothing to say)."""
        raise NotImplementedError

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        """A stream's tail, after every choice finished."""
        raise NotImplementedError

    def add(self, index: int, piece: Piece, logprobs: list[tuple[int, tuple]], token_ids: list[int],
            finish_reason: str | None) -> None:
        """What choice `index` adds now (a whole body's part; a stream's too where `takes_each_piece`)."""
        raise NotImplementedError

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        """The whole body, after every choice finished."""
        raise NotImplementedError

    def add_prompt_logprobs(self, start: int, prompt_ids: list[int], entries: list[tuple]) -> None:
        """Scores of prompt positions start, start+1, ... (dialects without prompt logprobs never ask)."""

    def stopped_by(self, index: int, stop: str) -> None:
        """The stop string that ended choice `index`."""

    def text_chunk(self, index: int, piece: Piece) -> bytes | None:
        """A fast way to frame an opened choice's piece of plain text alone; None: `chunk` it."""
        return None

    def take_sizes(self) -> list[int]:
        """The byte lengths of the last events of what this framer returned since the last take (Frame.sizes):
        here, the closing event's once `end` wrote it."""
        sizes, self.closing = [self.closing] if self.closing else [], 0
        return sizes


class ItemFramer(Framer, Events):
    """A dialect whose output is one list of items (one choice): every token's piece goes to one Assembly,
    whose events (Events) the dialect tells; `finish_reason` is the choice's."""

    takes_each_piece = True

    def __init__(self) -> None:
        self.assembly = Assembly(self)
        self.finish_reason: str | None = None

    def add(self, index: int, piece: Piece, logprobs: list[tuple[int, tuple]], token_ids: list[int],
            finish_reason: str | None) -> None:
        self.assembly.feed(piece)
        if finish_reason:
            self.finish_reason = finish_reason


FramerFactory = Callable[[PostprocSpec, int, int, TokenText], Framer]  # (spec, prompt tokens, cached, text_of)
FRAMERS: dict[Endpoint, FramerFactory] = {}
# add to FRAMERS
_MODULES = ("sluice.postproc.openai_frames", "sluice.postproc.anthropic_frames", "sluice.postproc.responses_frames",
            "sluice.postproc.token_frames")


def framer_for(spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of: TokenText) -> Framer:
    if spec.endpoint not in FRAMERS:
        for name in _MODULES:
            importlib.import_module(name)
    return FRAMERS[spec.endpoint](spec, num_prompt_tokens, num_cached_tokens, text_of)
