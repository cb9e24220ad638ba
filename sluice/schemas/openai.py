"""The OpenAI dialect: request Structs (validated by the ingress, read by the
render pool) and response Structs (encoded by the postproc pool).

Top-level request fields are strict: an unknown field is a 400 that names it,
because a silently ignored constraint fails open; every field of the SDK's create
calls is decided in ipc/sdk_fields.py (honoured, a hint, or refused with a 400
that says why; null is always unset). Messages are lenient, since SDKs send back
assistant messages with extra fields (refusal, annotations...).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluice.schemas import sdk_fields

_STRICT = dict(forbid_unknown_fields=True, omit_defaults=True)

# Every integer is bounded where it is declared: past the ingress, integers travel as msgpack int64 (token
# ids and counts as int32) and land in numpy arrays, where an unbounded one is a crash, not a 400.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX)]  # render clamps it to the vocabulary
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]  # render checks it against the vocabulary
Stop = str | Annotated[list[str], Meta(max_length=16)] | None
# OpenAI's metadata: up to 16 keys of up to 64 characters, string values of up to 512.
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=16)]


# The API's reasoning efforts. gpt-oss and the chat templates that read an effort know three levels: the others
# are the nearest of those (none and minimal: low; xhigh and max: high).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
EFFORT_LEVEL: dict[str, Literal["low", "medium", "high"]] = {
    "none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class StreamOptions(msgspec.Struct, **_STRICT):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None  # (padding against length side channels: never added here)


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, omit_defaults=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ContentPart(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None


class Prediction(msgspec.Struct, **_STRICT):
    """Predicted Outputs: text the output is expected to match for the most part (the engine verifies it as a
    speculative draft; the output is the same without it)."""

    type: Literal["content"]
    content: str | list[ContentPart]


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class Tool(msgspec.Struct, kw_only=True):
    # OpenAI's field order, so templates that dump a tool as JSON show it as the client sent it
    type: Literal["function"] = "function"
    function: FunctionDef


Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StructuredOutputs(msgspec.Struct, **_STRICT):
    """vLLM's structured_outputs: what the output must match, one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema (or its JSON text)
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    json_object: bool | None = None


class DisaggregatedParams(msgspec.Struct, omit_defaults=True):
    """Disaggregated serving, in TensorRT-LLM's wire shape (tensorrt_llm/serve/openai_protocol.py), so that its
    `trtllm-serve disaggregated` orchestrator and `sluice router` drive the same workers: a context_only request
    computes the prompt's KV and answers these (in its one choice) with the first token of each choice and the
    encoded opaque state; a generation_only request sends them back to a generation worker, which imports the KV
    and decodes. Sluice's own state (the transfer handle, the prompt ids) travels inside encoded_opaque_state.
    Accepted only from the orchestrator (its shared secret), never from clients. Fields a worker does not know are
    ignored with a log line (sluice/base/disagg.py), so that a newer orchestrator can drive an older worker."""

    request_type: Literal["context_only", "generation_only", "context_and_generation"]
    first_gen_tokens: list[TokenId] | None = None  # one per choice
    first_gen_log_probs: list[Any] | None = None  # each first token's logprob: a float, or [{token_id, logprob, rank}]
    first_gen_logits: list[Any] | None = None  # (TensorRT-LLM's; not produced or read here)
    ctx_request_id: Int64 | None = None
    encoded_opaque_state: str | None = None  # base64 of what the context engine needs back (opaque to the rest)
    draft_tokens: list[TokenId] | None = None  # (speculative decoding's: not read here)
    disagg_request_id: Int64 | None = None  # the orchestrator's id for the pair: a context answer carries it back
    ctx_dp_rank: Count | None = None
    ctx_info_endpoint: str | list[str] | None = None
    schedule_style: Annotated[int, Meta(ge=0, le=1)] | None = None  # 0: context first (the only one served here)
    ctx_usage: dict[str, Any] | None = None
    return_prompt_token_ids_b64: bool = False  # a context answer also gives the prompt ids as base64 int32
    resolved_thinking: bool | None = None


class _Sampling(msgspec.Struct, **_STRICT):
    """Fields shared by chat and completions."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Int64 | None = None  # the engine takes it mod 2**63
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The body's "n" (a null is unset, as for every field): read as `n`, always a count.
    n_choices: Annotated[int, Meta(ge=1, le=128)] | None = msgspec.field(default=None, name="n")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output (its router sends it)
    skip_special_tokens: bool = True
    prompt_logprobs: TopLogprobs | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    prompt_token_ids_b64: str | None = None
    return_prompt_token_ids_b64: bool = False
    return_token_ids: bool = False
    structured_outputs: StructuredOutputs | None = None
    disaggregated_params: DisaggregatedParams | None = None
    # KV-cache hints (the envelope vLLM and SGLang share: protocol_version, message_id, actions such as kv.retain):
    # they steer what the shared cache keeps, so only the orchestrator sends them (TRTLLM_TRUST_KV_HINTS)
    kv_hints: dict[str, Any] | None = None

    @property
    def n(self) -> int:
        return self.n_choices or 1


_CHAT_REFUSALS = sdk_fields.refused_fields(sdk_fields.CHAT_COMPLETIONS)
_COMPLETIONS_REFUSALS = sdk_fields.refused_fields(sdk_fields.COMPLETIONS)


class ChatCompletionRequest(_Sampling, **_STRICT):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] = []
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final message left open, the output continues it
    # SGLang's, which its router and vLLM's send with every request: reasoning apart from the answer, streamed
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_hidden_states: bool = False
    include_reasoning: bool = True  # vLLM's: False leaves the reasoning out of the response
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: Count | None = None
    # The rest of the SDK's fields: hints, and refusals (what ipc/sdk_fields.py says of each; null is unset).
    metadata: Metadata | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: Prediction | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    moderation: Any = None

    def __post_init__(self) -> None:
        sdk_fields.refuse(self, _CHAT_REFUSALS)


class CompletionRequest(_Sampling, **_STRICT):
    # A string, token ids, or a one-element list of either (the render pool checks the shape).
    prompt: str | Annotated[list[Any], Meta(min_length=1)] = ""
    max_tokens: PositiveInt | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool | None = False
    best_of: Int64 | None = None  # (refused past 1: ipc/sdk_fields.py)
    suffix: str | None = None

    def __post_init__(self) -> None:
        sdk_fields.refuse(self, _COMPLETIONS_REFUSALS)


# ---- responses ---------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0  # draft tokens of the predicted output that the output kept
    rejected_prediction_tokens: int = 0  # draft tokens verified and not kept (billed as output tokens by OpenAI)


class PredictedUsage(Usage):
    """A request with a predicted output's usage (the others' keep the shape they had)."""

    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobList = list[dict[str, PromptLogprob] | None]


class FunctionCallOut(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, omit_defaults=True):
    """A tool call in a response, or a piece of one in a stream delta."""

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionCallOut | None = None


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    content: str | None
    role: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class PerfMetrics(msgspec.Struct):
    """--perf-metrics: when the request passed each stage (Unix seconds)."""

    arrival_time: float
    render_done_time: float
    first_scheduled_time: float
    first_token_time: float
    last_token_time: float
    num_cached_tokens: int


class _Envelope(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Top-level response fields; the optional extensions appear only when asked for."""

    id: str
    object: str
    created: int
    model: str
    prompt_logprobs: PromptLogprobList | None = None
    prompt_token_ids_b64: str | None = None
    prompt_token_ids: list[int] | None = None
    perf_metrics: PerfMetrics | None = None
    service_tier: Literal["default"] | None = None  # where the request named a tier: the one it was served on


class ChatCompletion(_Envelope, kw_only=True, omit_defaults=True):
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Envelope, kw_only=True, omit_defaults=True):
    choices: list[ChunkChoice]
    usage: Usage | None  # null but present, as OpenAI sends it with include_usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobList | None = None
    token_ids: list[int] | None = None


class Completion(_Envelope, kw_only=True, omit_defaults=True):
    choices: list[CompletionChoice]
    usage: Usage | None


class TokenizeRequest(msgspec.Struct, **_STRICT):
    """vLLM's POST /tokenize: a prompt (as /v1/completions takes it), or chat messages rendered as
    /v1/chat/completions renders them; the ids the model would be given."""

    model: str | None = None  # (the served model, where left out)
    prompt: str | Annotated[list[Any], Meta(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, **_STRICT):
    """vLLM's POST /detokenize: token ids back to text (special tokens kept)."""

    tokens: list[TokenId]
    model: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "sluice"
    max_model_len: int | None = None
    root: str | None = None
    object: str = "model"
    sampling_defaults: dict[str, float] = {}  # what a request that sets none samples with (--generation-config)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> bytes:
    kind = _ERROR_TYPES.get(status, "server_error")
    return msgspec.json.encode(ErrorResponse(ErrorInfo(message, kind, param, code)))
