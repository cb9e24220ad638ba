"""The shared chat core: one handler for every model and dialect."""
from __future__ import annotations

import msgspec

from ipc.addresses import shard_of
from ipc.messages import EngineRequest, PostprocSpec, RenderJob, SamplingParams, ids_to_bytes
from ipc.openai import ChatCompletionRequest, CompletionRequest
from render.errors import RequestError
from render.extensions import ServingExtension
from render.tokenizer import TokenizerBundle

_DECODERS = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completions": msgspec.json.Decoder(CompletionRequest),
}
_spec_encoder = msgspec.msgpack.Encoder()


class ChatCore:
    def __init__(self, extension: ServingExtension, bundle: TokenizerBundle, *, max_model_len: int,
                 model_vocab_size: int, num_shards: int) -> None:
        self.ext = extension
        self.bundle = bundle
        self.max_model_len = max_model_len
        self.model_vocab_size = model_vocab_size
        self.num_shards = num_shards

    def render(self, job: RenderJob) -> EngineRequest:
        request = _DECODERS[job.endpoint].decode(job.body)
        if job.endpoint == "chat":
            for item in self.ext.unsupported_features(request):
                raise RequestError(400, f"{item.feature} is not supported by this model: {item.message}",
                                   code="unsupported_feature")
            prompt = self.ext.render_prompt(request)
            max_tokens = request.max_completion_tokens or request.max_tokens
        else:
            prompt = self._completion_prompt(request)
            max_tokens = request.max_tokens
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
            output_mode=self.ext.output_mode,
        )
        return EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=ids_to_bytes(prompt),
            sampling=self._sampling(request, max_tokens),
            shard=shard_of(job.request_id, self.num_shards),
            postproc_spec=_spec_encoder.encode(spec),
            arrival_time=job.arrival_time,
        )

    def _completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.bundle.tokenizer.encode(prompt, add_special_tokens=True).ids
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = prompt
            if any(t < 0 or t >= self.model_vocab_size for t in ids):
                raise RequestError(400, f"prompt token ids must be in [0, {self.model_vocab_size})", param="prompt")
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

    def _sampling(self, r: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
        stop_ids = list(r.stop_token_ids or [])
        if not r.ignore_eos:
            stop_ids.extend(self.bundle.eos_token_ids)
        stop_ids.extend(self.ext.extra_stop_token_ids())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            top_k=0 if r.top_k in (None, -1) else r.top_k,
            min_p=r.min_p or 0.0,
            seed=r.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            min_tokens=min(r.min_tokens, max_tokens),
        )
