"""The shared chat core: one handler for every model and dialect."""
from __future__ import annotations

import base64
import binascii
import time

import msgspec
import numpy as np

from ipc.addresses import shard_of
from ipc.messages import EngineRequest, PostprocSpec, RenderJob, SamplingParams, ids_to_bytes
from ipc.openai import ChatCompletionRequest, CompletionRequest
from render.errors import RequestError
from render.extensions import ServingExtension
from render.structured import GrammarCompiler
from render.tokenizer import TokenizerBundle

_DECODERS = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completions": msgspec.json.Decoder(CompletionRequest),
}
_spec_encoder = msgspec.msgpack.Encoder()


class ChatCore:
    def __init__(self, extension: ServingExtension, bundle: TokenizerBundle, *, max_model_len: int,
                 model_vocab_size: int, num_shards: int, grammars: GrammarCompiler | None = None,
                 perf_metrics: bool = False, stream_interval: int = 1) -> None:
        self.ext = extension
        self.perf_metrics = perf_metrics
        self.stream_interval = stream_interval
        self.grammars = grammars
        self.bundle = bundle
        self.max_model_len = max_model_len
        self.model_vocab_size = model_vocab_size
        self.num_shards = num_shards

    def render(self, job: RenderJob) -> EngineRequest:
        request = _DECODERS[job.endpoint].decode(job.body)
        grammar, trigger = "", []
        if job.endpoint == "chat":
            for item in self.ext.unsupported_features(request):
                raise RequestError(400, f"{item.feature} is not supported by this model: {item.message}",
                                   code="unsupported_feature")
            prompt, prefix = self._pretokenized(request), []
            if prompt is None:
                rendered = self.ext.render_prompt(request)
                prompt, prefix = rendered.prompt_ids, rendered.output_prefix
            max_tokens = request.max_completion_tokens or request.max_tokens
            if request.response_format is not None and request.response_format.type != "text":
                grammar = self.grammars.compile(request.response_format)
                trigger = self.ext.structured_output_format(request)
            top_logprobs = request.top_logprobs if request.logprobs else None
            if request.top_logprobs is not None and not request.logprobs:
                raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            echo = ""
        else:
            prompt, prefix = self._pretokenized(request), []
            if prompt is None:
                prompt = self._completion_prompt(request)
            max_tokens = request.max_tokens
            top_logprobs = request.logprobs
            echo = self._echo_text(request, prompt) if request.echo else ""
        max_tokens = self._check_length(len(prompt), max_tokens)
        spec = PostprocSpec(
            request_id=job.request_id,
            endpoint=job.endpoint,
            model=request.model,
            created=int(job.arrival_time),
            reply_to=job.reply_to,
            stream=bool(request.stream),
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
            output_mode=self.ext.output_mode if job.endpoint == "chat" else "text",
            parsers=self.ext.parsers() if job.endpoint == "chat" else [],
            output_prefix=prefix,
            return_token_ids=request.return_token_ids,
            prompt_token_ids=prompt if request.return_token_ids else None,
            arrival_time=job.arrival_time,
            perf_metrics=self.perf_metrics,
            stream_interval=self.stream_interval,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            n=request.n,
            logprobs=top_logprobs is not None,
            echo=echo,
            prompt_token_ids_b64=_b64(prompt) if request.return_prompt_token_ids_b64 else None,
        )
        return EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=ids_to_bytes(prompt),
            sampling=self._sampling(request, max_tokens, top_logprobs),
            shard=shard_of(job.request_id, self.num_shards),
            postproc_spec=_spec_encoder.encode(spec),
            arrival_time=job.arrival_time,
            n=request.n,
            priority=request.priority,
            cache_salt=request.cache_salt or "",
            grammar=grammar,
            grammar_trigger=trigger,
            render_done_time=time.time(),
        )

    def _pretokenized(self, request) -> list[int] | None:
        """Prompt ids the client sent itself (`prompt_token_ids`, `prompt_token_ids_b64`), if any."""
        ids, field = getattr(request, "prompt_token_ids", None), "prompt_token_ids"
        if request.prompt_token_ids_b64 is not None:
            if ids is not None:
                raise RequestError(400, "send prompt_token_ids or prompt_token_ids_b64, not both",
                                   param="prompt_token_ids_b64")
            ids, field = _from_b64(request.prompt_token_ids_b64), "prompt_token_ids_b64"
        if ids is None:
            return None
        if not ids:
            raise RequestError(400, "the prompt is empty", param=field)
        self._check_ids(ids, field)
        return ids

    def _check_ids(self, ids, field: str) -> None:
        if any(t < 0 or t >= self.model_vocab_size for t in ids):
            raise RequestError(400, f"token ids must be in [0, {self.model_vocab_size})", param=field)

    def _echo_text(self, request: CompletionRequest, prompt: list[int]) -> str:
        if isinstance(request.prompt, str):
            return request.prompt
        if isinstance(request.prompt, list) and len(request.prompt) == 1 and isinstance(request.prompt[0], str):
            return request.prompt[0]
        return self.bundle.tokenizer.decode(prompt, skip_special_tokens=False)

    def _completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.bundle.tokenizer.encode(prompt, add_special_tokens=True).ids
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = prompt
            self._check_ids(ids, "prompt")
        else:
            raise RequestError(400, "prompt must be a string, a list of token ids, or a one-element list of either "
                               "(batched prompts are not supported yet)", param="prompt")
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt")
        return ids

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise RequestError(
                400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens. Please reduce the length of the prompt.",
                param="messages", code="context_length_exceeded")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise RequestError(
                400, f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _sampling(self, r: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                  top_logprobs: int | None) -> SamplingParams:
        stop_ids = list(r.stop_token_ids or [])
        if not r.ignore_eos:
            stop_ids.extend(self.bundle.eos_token_ids)
        stop_ids.extend(self.ext.extra_stop_token_ids())
        if r.allowed_token_ids:
            self._check_ids(r.allowed_token_ids, "allowed_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            top_k=0 if r.top_k in (None, -1) else r.top_k,
            min_p=r.min_p or 0.0,
            seed=r.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            min_tokens=min(r.min_tokens, max_tokens),
            presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=r.repetition_penalty or 1.0,
            logit_bias=self._logit_bias(r.logit_bias),
            bad_words_ids=self._bad_words(r.bad_words or []),
            allowed_token_ids=r.allowed_token_ids,
            logprobs=top_logprobs,
            prompt_logprobs=r.prompt_logprobs,
        )

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        out = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(400, f"logit_bias keys are token ids; got {key!r}", param="logit_bias") from None
            self._check_ids([token], "logit_bias")
            out[token] = value
        return out

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it starts the text and as it follows a space (as vLLM)."""
        out: list[list[int]] = []
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.bundle.tokenizer.encode(variant, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out


def _b64(ids: list[int]) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def _from_b64(text: str) -> list[int]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, "prompt_token_ids_b64 is not valid base64", param="prompt_token_ids_b64") from None
    if len(raw) % 4:
        raise RequestError(400, "prompt_token_ids_b64 must decode to little-endian int32s (a multiple of 4 bytes)",
                           param="prompt_token_ids_b64")
    return np.frombuffer(raw, dtype="<i4").tolist()
