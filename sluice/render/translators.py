"""Dialects other than OpenAI's chat and completions. Each translates its request into the one chat core's
request (an OpenAI chat request: messages, tools, tool_choice, sampling, response_format) and says what its
postproc framer needs beyond it (PostprocSpec.dialect, its own Struct encoded). Nothing after the
translation knows which dialect asked."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from sluice.schemas.openai import ChatCompletionRequest

if TYPE_CHECKING:
    from sluice.render.diagnostics import Fingerprints


@dataclass(frozen=True)
class Translation:
    request: ChatCompletionRequest
    dialect: bytes = b""  # for the dialect's framer (opaque to the core)
    # A prompt that does not fit may lose its oldest turns (the Responses API's truncation 'auto'), the
    # fewest that make it fit (render/truncation.py).
    truncate: bool = False
    # A translation that needs more than the body (token counts, what earlier requests left): the core
    # calls it with them, and takes the translation it returns instead.
    finish: Callable[[Finish], Translation] | None = None


@dataclass(frozen=True)
class Finish:
    """What a translation's `finish` is given."""

    request_id: str
    count: Callable[[str], int]  # a text's tokens, by the model's tokenizer
    fingerprints: Fingerprints | None = None  # prompts kept for Anthropic's diagnostics


Translator = Callable[[bytes], Translation]  # the request body (JSON, validated by the ingress) -> the core's
TRANSLATORS: dict[str, Translator] = {}
_MODULES = ("sluice.render.anthropic", "sluice.render.responses")  # the modules that register them


def translator(endpoint: str) -> Callable[[Translator], Translator]:
    def register(fn: Translator) -> Translator:
        TRANSLATORS[endpoint] = fn
        return fn
    return register


def load() -> dict[str, Translator]:
    for name in _MODULES:
        importlib.import_module(name)
    return TRANSLATORS
