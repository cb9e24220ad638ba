"""The shared chat core: one handler for every model and dialect."""
from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Callable, Iterator, TypeVar

import msgspec

from sluice.ipc.addresses import shard_of
from sluice.ipc.messages import EngineRequest, PostprocSpec, RenderJob, SamplingParams, ids_to_bytes
from sluice.render import deadline, translators
from sluice.render.constraints import check_tool_choice, requested
from sluice.render.diagnostics import Fingerprints
from sluice.render.disagg import ids_from_b64, ids_to_b64, imported_prompt, kv_of
from sluice.render.errors import RequestError
from sluice.render.extensions import ServingExtension, message_text, tool_param_types
from sluice.render.structured import Constraint, GrammarCompiler, response_format
from sluice.render.tokenizer import PromptBudget, TokenizerBundle, context_length_error
from sluice.render.truncation import Turns, fitting, guess_dropped, message_overhead
from sluice.schemas.openai import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice,
                                   TokenizeResponse)

_DECODERS: dict[str, msgspec.json.Decoder] = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completions": msgspec.json.Decoder(CompletionRequest),
}
_spec_encoder = msgspec.msgpack.Encoder()
T = TypeVar("T")
# How deeply a free-form JSON field (a tool's parameters, a schema) may nest: past it, json.dumps, templates
# and harmony's renderer fail on the recursion. Real schemas nest a few dozen levels at most.
MAX_JSON_DEPTH = 100


class ChatCore:
    def __init__(self, extension: ServingExtension, bundle: TokenizerBundle, *, max_model_len: int,
                 model_vocab_size: int, num_shards: int, grammars: GrammarCompiler | None = None,
                 perf_metrics: bool = False, stream_interval: int = 1,
                 sampling_defaults: dict[str, float] | None = None, fingerprints: Fingerprints | None = None) -> None:
        """`sampling_defaults`: a request's sampling values where it sets none (--generation-config);
        `fingerprints`: where the prompts that ask for diagnostics are kept."""
        self.fingerprints = fingerprints
        self.ext = extension
        self.defaults = sampling_defaults or {}
        self.perf_metrics = perf_metrics
        self.stream_interval = stream_interval
        self.grammars = grammars
        self.bundle = bundle
        self.max_model_len = max_model_len
        self.model_vocab_size = model_vocab_size
        self.num_shards = num_shards
        self.translators = translators.load()

    @property
    def budget(self) -> PromptBudget:
        return PromptBudget(self.max_model_len, self.bundle.max_token_chars)

    def render(self, job: RenderJob) -> EngineRequest:
        request, dialect, truncate = self._translate(job)
        return self._fitting(request, truncate, lambda r: self._render(job, r, dialect))

    def count(self, job: RenderJob) -> int:
        """The number of prompt tokens `job` renders to, rendered as `render` does, without generating."""
        request, _, truncate = self._translate(job)
        if not isinstance(request, ChatCompletionRequest):
            raise RequestError(400, "only chat requests are counted")
        return self._fitting(request, truncate, lambda r: len(self._chat_prompt(r)[0]))

    def tokenized(self, job: RenderJob) -> TokenizeResponse:
        """/tokenize: the prompt ids the job's chat or completions request renders to, each token's string."""
        ids = self.prompt(job)[0]
        strings = [self.bundle.tokenizer.id_to_token(i) or "" for i in ids]
        return TokenizeResponse(len(ids), self.max_model_len, ids, strings)

    def detokenized(self, job: RenderJob) -> dict[str, str]:
        """/detokenize: the text of the ids the job's body carries (special tokens kept)."""
        ids = msgspec.json.decode(job.body, type=DetokenizeRequest).tokens
        self._check_ids(ids, "tokens")
        return {"prompt": self._decode(ids)}

    def prompt(self, job: RenderJob) -> tuple[list[int], str]:
        """The prompt ids `job` renders to and its cache salt, and nothing else of a render (no grammar, no
        sampling): what a router hashes to count a request's cached prefix on each worker."""
        request, _, truncate = self._translate(job)
        if isinstance(request, ChatCompletionRequest):
            return self._fitting(request, truncate, lambda r: self._chat_prompt(r)[0]), request.cache_salt or ""
        return self._completion_prompt(request)[0], request.cache_salt or ""

    def _fitting(self, request, truncate: bool, attempt: Callable[[Any], T]) -> T:
        """attempt(request), or where its prompt does not fit and the dialect truncates (the Responses API's
        truncation 'auto'), attempt(it without the fewest oldest turns that make it fit)."""
        return fitting(request, truncate, attempt, self._guess_dropped)

    def _guess_dropped(self, turns: Turns) -> int:
        """Where the search for the turns to drop starts: counted from their text, what leaves room for the
        output (at least one token)."""
        r = turns.request
        room = self.max_model_len - max(r.max_completion_tokens or r.max_tokens or 1, 1)
        return guess_dropped(turns, room, self._tokens, self._message_overhead, self.bundle.max_token_chars)

    def _tokens(self, text: str) -> int:
        return len(self.bundle.tokenizer.encode(text, add_special_tokens=False).ids)

    @cached_property
    def _message_overhead(self) -> float:
        """The tokens the chat template adds around a message's text (measured once)."""
        return message_overhead(lambda r: len(self.ext.render_prompt(r, self.budget).prompt_ids), self._tokens)

    def _translate(self, job: RenderJob) -> tuple[ChatCompletionRequest | CompletionRequest, bytes, bool]:
        """The core's request for the job, what its dialect's framer needs, and whether its oldest turns may go."""
        try:
            if (translate := self.translators.get(job.endpoint)) is not None:
                translation = translate(job.body)
                if translation.finish is not None:
                    finish = translators.Finish(job.request_id, self._tokens, self.fingerprints)
                    translation = translation.finish(finish)
                return translation.request, translation.dialect, translation.truncate
            return _DECODERS[job.endpoint].decode(job.body), b"", False
        except RecursionError:
            raise RequestError(400, "the JSON body nests too deeply") from None

    def _render(self, job: RenderJob, request: ChatCompletionRequest | CompletionRequest,
                dialect: bytes = b"") -> EngineRequest:
        chat = isinstance(request, ChatCompletionRequest)
        imported = imported_prompt(job, request, self._check_ids, self._decode)  # (its context worker's)
        if isinstance(request, ChatCompletionRequest):
            prompt, prefix, echo = imported or (*self._chat_prompt(request), "")
            max_tokens = request.max_completion_tokens or request.max_tokens
            max_tokens_field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            constraint = self._chat_constraint(request, prefix)
            grammar, trigger = self._grammar(request, constraint)
            if request.top_logprobs is not None and not request.logprobs:
                raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            top_logprobs = request.top_logprobs if request.logprobs else None
            predicted = self._prediction(request)
        else:
            (prompt, echo), prefix = (imported[::2] if imported else self._completion_prompt(request)), []
            max_tokens, top_logprobs = request.max_tokens, request.logprobs
            constraint = requested(request)
            grammar, trigger = self._grammar(request, constraint)
            max_tokens_field = "max_tokens"
            predicted = []
        max_tokens = self._check_length(len(prompt), max_tokens, max_tokens_field)
        parsers = self.ext.parsers() if chat else []
        spec = PostprocSpec(
            request_id=job.request_id,
            endpoint=job.endpoint,
            model=request.model,
            created=int(job.arrival_time),
            reply_to=job.reply_to,
            stream=bool(request.stream),
            store=bool(getattr(request, "store", None)),  # (chat's store, or the Responses translator's)
            service_tier=getattr(request, "service_tier", None) is not None,
            prediction=getattr(request, "prediction", None) is not None,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            continuous_usage=bool(request.stream_options and request.stream_options.include_usage
                                  and request.stream_options.continuous_usage_stats),
            parallel_tool_calls=getattr(request, "parallel_tool_calls", None) is not False,
            include_reasoning=getattr(request, "include_reasoning", True),
            user=request.user,
            stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
            output_mode=self.ext.output_mode if chat else "text",
            parsers=parsers,
            tool_param_types=tool_param_types(request, parsers) if isinstance(request, ChatCompletionRequest) else {},
            dialect=dialect,
            output_prefix=prefix,
            return_token_ids=request.return_token_ids,
            prompt_token_ids=prompt if request.return_token_ids else None,
            arrival_time=job.arrival_time,
            perf_metrics=self.perf_metrics,
            stream_interval=self.stream_interval,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output or request.no_stop_trim,
            n=request.n,
            logprobs=top_logprobs is not None,
            echo=echo,
            prompt_token_ids_b64=ids_to_b64(prompt) if request.return_prompt_token_ids_b64 else None,
            trace=job.trace,
        )
        return EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=ids_to_bytes(prompt),
            sampling=self._sampling(request, max_tokens, top_logprobs),
            shard=shard_of(job.request_id, self.num_shards),
            postproc_spec=_spec_encoder.encode(spec),
            arrival_time=job.arrival_time,
            n=request.n,
            priority=request.priority if job.priority is None else job.priority,
            cache_salt=request.cache_salt or "",
            grammar=grammar,
            grammar_trigger=trigger,
            grammar_param=constraint[0].param if constraint[0] is not None else "",
            render_done_time=time.time(),
            kv=kv_of(job, request, len(prefix), top_logprobs, self._check_ids),
            prediction=ids_to_bytes(predicted) if predicted else b"",
        )

    def _chat_prompt(self, request: ChatCompletionRequest) -> tuple[list[int], list[int]]:
        """The prompt's ids, and those of its end that begin the output (a forced tool call)."""
        for item in self.ext.unsupported_features(request):
            raise RequestError(400, f"{item.feature} is not supported by this model: {item.message}",
                               param=item.param, code="unsupported_feature")
        _check_nesting(request)
        check_tool_choice(request)
        ids = self._pretokenized(request)
        if ids is not None:
            if request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice):
                raise RequestError(400, "a tool_choice that forces a call needs the server to render the prompt: "
                                   "send messages instead of prompt token ids", param="tool_choice")
            return ids, []
        # Text that every template renders: past the budget, the prompt cannot fit however it renders.
        self.budget.check_chars(sum(len(message_text(m)) for m in request.messages if m.role != "assistant"))
        rendered = self.ext.render_prompt(request, self.budget)
        return rendered.prompt_ids, rendered.output_prefix

    def _chat_constraint(self, request: ChatCompletionRequest,
                         prefix: list[int]) -> tuple[Constraint | None, bool]:
        """What a chat output must match (and whether it is the whole output, or the answer the serving
        extension says where to find): the client's format, the serving extension's grammar for tool calls
        that must be made or held to their schemas, or the one that holds a thinking budget."""
        own = requested(request)
        if request.response_format is not None and (fmt := response_format(request.response_format)) is not None:
            if own[0] is not None:
                raise RequestError(400, "send response_format or structured_outputs, not both",
                                   param="structured_outputs")
            own = fmt, False
        tools = self.ext.tool_constraint(request)
        if tools is not None and own[0] is not None:
            raise RequestError(400, f"{own[0].param} cannot be combined with tool calls that are forced or strict "
                               "(tool_choice required or a named function, or strict tools)", param=own[0].param)
        budget = self.ext.thinking_constraint(request, prefix)
        if budget is not None and (other := tools or own[0]) is not None:
            raise RequestError(400, f"thinking_token_budget cannot be combined with {other.param} here (one grammar "
                               "a request)", param="thinking_token_budget")
        return (tools, True) if tools is not None else (budget, True) if budget is not None else own

    def _grammar(self, request, constraint: tuple[Constraint | None, bool]) -> tuple[str, list[int]]:
        """The constraint's compiled grammar, and the ids after which it applies."""
        c, whole = constraint
        if c is None:
            return "", []
        if self.grammars is None:
            raise RequestError(400, "this server does not constrain outputs", param=c.param)
        chat = isinstance(request, ChatCompletionRequest)
        with deadline.shielded():  # (its exchange with the compile process must not be cut: it has its own limit)
            grammar = self.grammars.compile(c)
        return grammar, [] if whole or not chat else self.ext.structured_output_format(request)

    def _pretokenized(self, request) -> list[int] | None:
        """Prompt ids the client sent itself (`prompt_token_ids`, `prompt_token_ids_b64`), if any."""
        ids, field = getattr(request, "prompt_token_ids", None), "prompt_token_ids"
        if request.prompt_token_ids_b64 is not None:
            if ids is not None:
                raise RequestError(400, "send prompt_token_ids or prompt_token_ids_b64, not both",
                                   param="prompt_token_ids_b64")
            ids, field = ids_from_b64(request.prompt_token_ids_b64), "prompt_token_ids_b64"
        if ids is None:
            return None
        if not ids:
            raise RequestError(400, "the prompt is empty", param=field)
        self._check_ids(ids, field)
        return ids

    def _check_ids(self, ids, field: str) -> None:
        if any(t < 0 or t >= self.model_vocab_size for t in ids):
            raise RequestError(400, f"token ids must be in [0, {self.model_vocab_size})", param=field)

    def _completion_prompt(self, request: CompletionRequest) -> tuple[list[int], str]:
        """The prompt's ids, and the text that starts each completion with echo ("" without)."""
        ids = self._pretokenized(request)
        if ids is not None:
            if request.prompt != "":  # the OpenAI SDKs make `prompt` required: "" goes with the ids
                raise RequestError(400, "send prompt or prompt_token_ids_b64, not both", param="prompt_token_ids_b64")
            return ids, self._decode(ids) if request.echo else ""
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = self.budget.encode(self.bundle.tokenizer, prompt, add_special_tokens=True), prompt
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            self._check_ids(prompt, "prompt")
            ids, text = prompt, None
        else:
            raise RequestError(400, "prompt must be a string, a list of token ids, or a one-element list of either "
                               "(batched prompts are not supported yet)", param="prompt")
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt")
        if not request.echo:
            return ids, ""
        return ids, text if text is not None else self._decode(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.bundle.tokenizer.decode(ids, skip_special_tokens=False)

    def _check_length(self, prompt_len: int, max_tokens: int | None, field: str) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise context_length_error(limit, f"has {prompt_len} tokens")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise RequestError(
                400, f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or {field}.",
                param=field, code="context_length_exceeded")
        return max_tokens

    def _sampling(self, r: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                  top_logprobs: int | None) -> SamplingParams:
        stop_ids = list(r.stop_token_ids or [])
        self._check_ids(stop_ids, "stop_token_ids")  # xgrammar refuses (in the engine) an id past the vocabulary
        if not r.ignore_eos:
            stop_ids.extend(self.bundle.eos_token_ids)
        stop_ids.extend(self.ext.extra_stop_token_ids())
        if r.allowed_token_ids:
            self._check_ids(r.allowed_token_ids, "allowed_token_ids")
        d = self.defaults
        top_k = int(d.get("top_k", 0)) if r.top_k is None else r.top_k
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.get("temperature", 1.0) if r.temperature is None else r.temperature,
            top_p=d.get("top_p", 1.0) if r.top_p is None else r.top_p,
            top_k=0 if top_k in (0, -1) or top_k >= self.model_vocab_size else top_k,  # 0: off
            min_p=d.get("min_p", 0.0) if r.min_p is None else r.min_p,
            seed=r.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            min_tokens=min(r.min_tokens, max_tokens),
            presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=d.get("repetition_penalty", 1.0) if r.repetition_penalty is None
            else r.repetition_penalty,
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

    def _prediction(self, request: ChatCompletionRequest) -> list[int]:
        """The predicted output's token ids, as the output would hold its text (no special tokens added; what
        is past the longest output the server reads is of no use)."""
        if request.prediction is None:
            return []
        content = request.prediction.content
        text = content if isinstance(content, str) else "".join(p.text or "" for p in content if p.type == "text")
        ids = self.bundle.tokenizer.encode(text[: self.budget.max_chars], add_special_tokens=False).ids
        return ids[: self.max_model_len]

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it starts the text and as it follows a space (as vLLM)."""
        if sum(map(len, words)) > self.budget.max_chars:  # longer than any output, and slow to tokenize
            raise RequestError(400, f"bad_words are longer than {self.budget.max_chars} characters in all",
                               param="bad_words")
        out: list[list[int]] = []
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.bundle.tokenizer.encode(variant, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out


def _check_nesting(request: ChatCompletionRequest) -> None:
    for field, value in _free_form_fields(request):
        if _depth(value) > MAX_JSON_DEPTH:
            raise RequestError(400, f"{field} nests deeper than {MAX_JSON_DEPTH} levels", param=field)


def _free_form_fields(request: ChatCompletionRequest) -> Iterator[tuple[str, Any]]:
    for i, tool in enumerate(request.tools or []):
        yield f"tools[{i}].function.parameters", tool.function.parameters
    fmt = request.response_format
    if fmt is not None and fmt.json_schema is not None:
        yield "response_format.json_schema.schema", fmt.json_schema.schema
    yield "chat_template_kwargs", request.chat_template_kwargs


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in a JSON value, measured without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest
