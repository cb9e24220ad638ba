"""Serving extensions: everything model-specific the chat core asks about.

One chat core serves every model; a model family that renders or parses
differently adds an extension here (chosen from the checkpoint's model_type
through the registry), never a branch in the core.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec

from ipc.openai import ChatCompletionRequest, ChatMessage
from render.chat_template import ChatTemplateError, render_chat
from render.errors import RequestError
from render.tokenizer import TokenizerBundle


@dataclass(frozen=True)
class Unsupported:
    feature: str  # a stable name, e.g. "multimodal_input"
    message: str  # what to do instead


class ServingExtension(Protocol):
    output_mode: str  # "text": parse detokenized text; "tokens": parse token ids

    def render_prompt(self, request: ChatCompletionRequest) -> list[int]: ...

    def extra_stop_token_ids(self) -> tuple[int, ...]: ...

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]: ...


_REGISTRY: dict[str, Callable[..., ServingExtension]] = {}


def register(*model_types: str):
    def deco(factory):
        for t in model_types:
            _REGISTRY[t] = factory
        return factory
    return deco


def extension_for(hf_config: dict, bundle: TokenizerBundle) -> ServingExtension:
    factory = _REGISTRY.get(hf_config.get("model_type", ""), HfChatTemplateExtension)
    return factory(bundle)


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d = msgspec.to_builtins(m)
    if isinstance(m.content, list):
        d["content"] = "".join(p.text or "" for p in m.content if p.type == "text")
    if m.reasoning is not None and m.reasoning_content is None:
        d["reasoning_content"] = d.pop("reasoning")
    for call in d.get("tool_calls") or []:
        fn = call["function"]
        try:  # templates expect arguments as an object, the wire carries a JSON string
            fn["arguments"] = json.loads(fn["arguments"])
        except (ValueError, TypeError):
            pass
    return d


class HfChatTemplateExtension:
    """Any model with a Hugging Face chat template; output parsed as text."""

    output_mode = "text"

    def __init__(self, bundle: TokenizerBundle) -> None:
        self.bundle = bundle

    def render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if self.bundle.chat_template is None:
            raise RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = render_chat(
                self.bundle.chat_template,
                messages=[_message_dict(m) for m in request.messages],
                tools=[msgspec.to_builtins(t) for t in request.tools] if request.tools else None,
                add_generation_prompt=request.add_generation_prompt,
                **self.bundle.special_tokens,
            )
        except ChatTemplateError as e:
            raise RequestError(400, str(e), param="messages") from e
        return self.bundle.tokenizer.encode(text, add_special_tokens=False).ids

    def extra_stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]:
        out = []
        if any(isinstance(m.content, list) and any(p.type != "text" for p in m.content) for m in request.messages):
            out.append(Unsupported("multimodal_input", "this model takes text only; send content parts of type 'text'"))
        return out
