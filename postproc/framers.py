"""The dialects' framers: each turns one request's message pieces (content, reasoning, tool-call deltas),
finish reasons and usage into its dialect's stream events or whole body. RequestOutput drives whichever
the request's endpoint names; parsing and detokenizing before them are shared."""
from __future__ import annotations

import importlib
from typing import Callable, Protocol

from ipc.messages import Endpoint, PostprocSpec
from ipc.openai import PerfMetrics
from postproc.openai_frames import OpenAIFramer
from postproc.parsers import Piece

TokenText = Callable[[int], str]


class Framer(Protocol):
    def chunk(self, index: int, piece: Piece, finish_reason: str | None, logprobs: list[tuple[int, tuple]],
              token_ids: list[int], completion_tokens: int = 0) -> bytes:
        """A stream's bytes for what choice `index` adds now (empty when there is nothing to say)."""
        ...

    def end(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        """A stream's tail, after every choice finished."""
        ...

    def add(self, index: int, piece: Piece, logprobs: list[tuple[int, tuple]], token_ids: list[int],
            finish_reason: str | None) -> None:
        """A whole body's part: what choice `index` adds now."""
        ...

    def body(self, completion_tokens: int, perf: PerfMetrics | None = None) -> bytes:
        """The whole body, after every choice finished."""
        ...

    def add_prompt_logprobs(self, start: int, prompt_ids: list[int], entries: list[tuple]) -> None: ...


FramerFactory = Callable[[PostprocSpec, int, int, TokenText], Framer]  # (spec, prompt tokens, cached, text_of)
FRAMERS: dict[Endpoint, FramerFactory] = {"chat": OpenAIFramer, "completions": OpenAIFramer}


_MODULES = ("postproc.anthropic_frames", "postproc.responses_frames")  # the modules that add theirs to FRAMERS


def framer_for(spec: PostprocSpec, num_prompt_tokens: int, num_cached_tokens: int, text_of: TokenText) -> Framer:
    if spec.endpoint not in FRAMERS:
        for name in _MODULES:
            importlib.import_module(name)
    return FRAMERS[spec.endpoint](spec, num_prompt_tokens, num_cached_tokens, text_of)
