"""One request's output state in its postproc shard."""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ipc.messages import Frame, PostprocSpec
from postproc.openai_frames import OpenAIFramer
from postproc.stop import StopStrings


class RequestOutput:
    def __init__(self, spec: PostprocSpec, tokenizer: Tokenizer, num_prompt_tokens: int) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self._decode = DecodeStream(skip_special_tokens=spec.skip_special_tokens)
        self._stops = StopStrings(spec.stop)
        self._framer = OpenAIFramer(spec, num_prompt_tokens)
        self.completion_tokens = 0

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.stopped

    def on_token(self, token: int, finish_reason: str | None) -> Frame | None:
        """Feeds one generated token; `finish_reason` is the engine's verdict on it."""
        self.completion_tokens += 1
        text = ""
        if finish_reason != "stop":  # an engine "stop" means this token is a stop token: not shown
            text = self._decode.step(self._tokenizer, token) or ""
        text = self._stops.feed(text)
        if self._stops.stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self._stops.flush()
        return self._emit(text, finish_reason)

    def _emit(self, text: str, finish_reason: str | None) -> Frame | None:
        rid, done = self.spec.request_id, finish_reason is not None
        if self.spec.stream:
            data = self._framer.stream(text, finish_reason, self.completion_tokens)
            return Frame(rid, data, done) if data else None
        self._framer.add(text)
        return Frame(rid, self._framer.body(finish_reason, self.completion_tokens), True) if done else None
