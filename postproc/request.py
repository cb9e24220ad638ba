"""One request's output state in its postproc shard: a text pipeline per choice."""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ipc.messages import Frame, PostprocSpec, Started
from postproc.openai_frames import OpenAIFramer
from postproc.stop import StopStrings


class Choice:
    def __init__(self, spec: PostprocSpec) -> None:
        self.decode = DecodeStream(skip_special_tokens=spec.skip_special_tokens)
        self.stops = StopStrings(spec.stop, spec.include_stop_str_in_output)
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.pending_logprobs: list = []  # logprobs of tokens whose text is still held back (streaming)

    def on_token(self, tokenizer: Tokenizer, token: int, finish_reason: str | None) -> str:
        """Feeds one token with the engine's verdict on it; returns the text it releases."""
        self.num_tokens += 1
        text = ""
        if finish_reason != "stop":  # an engine "stop" means this token is a stop token: not shown
            text = self.decode.step(tokenizer, token) or ""
        text = self.stops.feed(text)
        if self.stops.stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self.stops.flush()
        self.finish_reason = finish_reason
        return text


class RequestOutput:
    def __init__(self, spec: PostprocSpec, tokenizer: Tokenizer, started: Started, text_of) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self.choices = [Choice(spec) for _ in range(spec.n)]
        self.framer = OpenAIFramer(spec, started.num_prompt_tokens, started.num_cached_tokens, text_of)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def on_token(self, index: int, token: int, finish_reason: str | None, logprobs: tuple | None) -> bytes:
        """Feeds choice `index` one token; returns the SSE bytes to send now (streaming)."""
        choice = self.choices[index]
        if choice.finish_reason is not None:  # a token in flight after a stop string ended the choice
            return b""
        text = choice.on_token(self._tokenizer, token, finish_reason)
        entries = [(token, logprobs)] if logprobs is not None and self.spec.logprobs else []
        if not self.spec.stream:
            self.framer.add(index, text, entries, choice.finish_reason)
            return b""
        choice.pending_logprobs += entries
        if not text and not choice.finish_reason:
            return self.framer.chunk(index, "", None, [])
        entries, choice.pending_logprobs = choice.pending_logprobs, []
        return self.framer.chunk(index, text, choice.finish_reason, entries)

    def final(self) -> Frame:
        if self.spec.stream:
            return Frame(self.spec.request_id, self.framer.end(self.completion_tokens), True)
        return Frame(self.spec.request_id, self.framer.body(self.completion_tokens), True)
