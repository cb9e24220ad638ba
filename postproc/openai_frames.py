"""OpenAI chat / completions output for one request: SSE frames or one body."""
from __future__ import annotations

import msgspec

from ipc.messages import PostprocSpec
from ipc.openai import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChunkChoice, Completion,
                        CompletionChoice, Delta, ResponseMessage, Usage)

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class OpenAIFramer:
    def __init__(self, spec: PostprocSpec, num_prompt_tokens: int) -> None:
        self.spec = spec
        self.num_prompt_tokens = num_prompt_tokens
        self._chat = spec.endpoint == "chat"
        self._sent_role = False
        self._parts: list[str] = []

    def usage(self, completion_tokens: int) -> Usage:
        return Usage(self.num_prompt_tokens, completion_tokens, self.num_prompt_tokens + completion_tokens)

    def stream(self, text: str, finish_reason: str | None, completion_tokens: int) -> bytes:
        """SSE bytes for this step (empty when there is nothing to say)."""
        out = b""
        if self._chat and not self._sent_role:
            self._sent_role = True
            out += sse(self._chunk(Delta(role="assistant", content=""), None))
        if text or finish_reason:
            out += sse(self._chunk(Delta(content=text) if self._chat else text, finish_reason))
        if finish_reason:
            if self.spec.include_usage:
                out += sse(self._envelope([], self.usage(completion_tokens)))
            out += DONE
        return out

    def add(self, text: str) -> None:
        self._parts.append(text)

    def body(self, finish_reason: str, completion_tokens: int) -> bytes:
        s, text = self.spec, "".join(self._parts)
        usage = self.usage(completion_tokens)
        if self._chat:
            choice = ChatChoice(0, ResponseMessage(text), finish_reason)
            return _json.encode(ChatCompletion(s.request_id, s.created, s.model, [choice], usage))
        return _json.encode(Completion(s.request_id, s.created, s.model, [CompletionChoice(0, text, finish_reason)],
                                       usage))

    def _chunk(self, delta, finish_reason: str | None):
        if self._chat:
            return self._envelope([ChunkChoice(0, delta, finish_reason)], None)
        return self._envelope([CompletionChoice(0, delta, finish_reason)], None)

    def _envelope(self, choices: list, usage: Usage | None):
        s = self.spec
        cls = ChatCompletionChunk if self._chat else Completion
        return cls(s.request_id, s.created, s.model, choices, usage)
