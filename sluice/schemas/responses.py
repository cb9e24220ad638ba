"""The OpenAI Responses API: the request (validated by the ingress, translated by render), the response with
its output items and stream events (built by the postproc framer, kept by the ingress and the background
owner), and what the responses endpoint's render job carries.

The request's top level is strict (an unknown field is a 400 naming it); every field of the SDK's create call
is decided in ipc/sdk_fields.py (honoured, a hint, or refused with a 400 that says why; null is always unset).
Items and tools are lenient, since clients send back the items they were given (with annotations, logprobs...);
what this server cannot honour (an image, an item type it never produces) is refused as the body is decoded,
with a message naming it. Tools it cannot offer the model (hosted ones) follow one policy: see `left_out`.
Reasoning comes back sealed where the request includes `reasoning.encrypted_content` (sluice/sealing.py).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from sluice.schemas import sdk_fields
from sluice.schemas.openai import Int64, Metadata, PositiveInt, ReasoningEffort, Temperature, TopP
from sluice.schemas.responses_tools import ResponsesTool, check_names, left_out, left_out_message

_STRICT = dict(forbid_unknown_fields=True, omit_defaults=True)
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "reasoning_text", "summary_text"})
Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "incomplete", "failed", "cancelled"})
ItemStatus = Literal["in_progress", "completed", "incomplete"]
_REFUSALS = sdk_fields.refused_fields(sdk_fields.RESPONSES)


# ---- the request -------------------------------------------------------------

class Part(msgspec.Struct, omit_defaults=True):
    """A text part of an item's content."""

    type: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.type not in TEXT_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported: this server takes text "
                             "(input_text) only")


Content = str | list[Part]
_NEEDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
          "function_call_output": ("call_id", "output"), "reasoning": ()}


class InputItem(msgspec.Struct, omit_defaults=True):
    """An item of a conversation: a message (an easy one has no type), a function call and its output, or
    the reasoning of an earlier response."""

    type: str = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    namespace: str | None = None  # a function_call's: the namespace tool its function belongs to
    output: Content | None = None
    summary: list[Part] | None = None
    encrypted_content: str | None = None  # a reasoning item's, as this server sealed it (render opens it)
    status: str | None = None

    def __post_init__(self) -> None:
        need = _NEEDS.get(self.type)
        if need is None:
            raise ValueError(f"input items of type {self.type!r} are not supported: send message, function_call, "
                             "function_call_output or reasoning items")
        for field in need:
            if getattr(self, field) is None:
                raise ValueError(f"a {self.type} item needs {field}")


def text_of(content: Content | None) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


class ToolChoiceFunction(msgspec.Struct, omit_defaults=True):
    type: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.type != "function" or not self.name:
            raise ValueError("tool_choice names a function ({'type': 'function', 'name': ...}) or is 'auto', "
                             "'none' or 'required'")


class TextFormat(msgspec.Struct, **_STRICT):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and (self.name is None or self.schema is None):
            raise ValueError("a json_schema format needs name and schema")


class TextConfig(msgspec.Struct, **_STRICT):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def __post_init__(self) -> None:
        if self.verbosity not in (None, "medium"):
            raise ValueError("text.verbosity: only the model's own verbosity ('medium', the default) is produced "
                             "here")


class ReasoningConfig(msgspec.Struct, **_STRICT):
    effort: ReasoningEffort | None = None  # (three levels where the model reads one: ipc.openai.EFFORT_LEVEL)
    # The reasoning item carries the whole reasoning text (content); there is no summarizer to run.
    summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(msgspec.Struct, **_STRICT):
    include_obfuscation: bool | None = None  # (padding against length side channels: never added here)


class CreateResponse(msgspec.Struct, **_STRICT):
    model: str
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: Metadata | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: for a chat template that reads them
    # The rest of the SDK's fields: hints, and refusals (what ipc/sdk_fields.py says of each; null is unset).
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: list[Any] | None = None
    max_tool_calls: Int64 | None = None
    top_logprobs: Int64 | None = None
    moderation: Any = None
    client_metadata: dict[str, Any] | None = None  # Codex's (no SDK parameter): about the client, a hint

    def __post_init__(self) -> None:
        sdk_fields.refuse(self, _REFUSALS)
        for value in self.include or []:
            if (why := sdk_fields.RESPONSES_INCLUDE.get(value, "not a value the API knows")) is not None:
                raise ValueError(f"include: {value!r} cannot be included: {why} - at `$.include`")
        check_names(self.tools)
        if self.background and self.store is False:
            raise ValueError("a background response is stored: drop store: false")
        if not self.input and self.previous_response_id is None:
            raise ValueError("input is empty")

    @property
    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)] if self.input else []
        return self.input

    @property
    def sealed_reasoning(self) -> bool:
        """Whether its reasoning items come back sealed (encrypted_content)."""
        return "reasoning.encrypted_content" in (self.include or [])


class RenderBody(msgspec.Struct, omit_defaults=True):
    """The responses endpoint's render job: the request, the stored conversation its previous_response_id
    names (read by whoever submits it, oldest item first), and for background work its creation time."""

    request: CreateResponse
    history: list[InputItem] = []
    created_at: int | None = None
    background: bool = False  # run by the background owner: its stream goes on from the stored response.created
    state_dir: str = ""  # the server's --state-dir, whose key seals and opens reasoning (sluice/sealing.py)


# ---- the response ------------------------------------------------------------

class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, kw_only=True):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    status: ItemStatus
    summary: list[Any] = []
    content: list[ReasoningText] = []
    encrypted_content: str | msgspec.UnsetType = msgspec.UNSET  # the text sealed (include asked; when done)


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    status: ItemStatus
    call_id: str
    name: str
    arguments: str = ""
    namespace: str | msgspec.UnsetType = msgspec.UNSET  # a namespace tool's function: the namespace


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class Usage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseWarning(msgspec.Struct):
    """Something of the request this server did not do, said rather than dropped (a response-level field of
    this server's: the SDKs keep fields they do not know)."""

    code: Literal["tool_not_offered"]
    message: str
    param: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem] = []
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    usage: Usage | None = None
    warnings: list[ResponseWarning] | msgspec.UnsetType = msgspec.UNSET  # (none: left out)
    # The request, as OpenAI echoes it:
    instructions: str | None = None
    tools: list[ResponsesTool] = []
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    text: TextConfig = msgspec.field(default_factory=lambda: TextConfig(TextFormat("text")))
    truncation: Literal["auto", "disabled"] = "disabled"
    previous_response_id: str | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = True
    background: bool = False
    service_tier: Literal["default"] = "default"  # (the tier it was served on: the one there is)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def new_response(request: CreateResponse, response_id: str, created_at: int, status: Status) -> Response:
    """The response to `request` before it has any output."""
    r = request
    warnings = [ResponseWarning("tool_not_offered", left_out_message(param, kind), param)
                for param, kind in left_out(r.tools)]
    return Response(
        id=response_id, created_at=created_at, status=status, model=r.model, instructions=r.instructions,
        warnings=warnings or msgspec.UNSET,
        tools=r.tools or [], tool_choice=r.tool_choice or "auto",
        parallel_tool_calls=r.parallel_tool_calls is not False, max_output_tokens=r.max_output_tokens,
        temperature=r.temperature, top_p=r.top_p,
        reasoning=r.reasoning or ReasoningConfig(), text=r.text or TextConfig(TextFormat("text")),
        truncation=r.truncation or "disabled", previous_response_id=r.previous_response_id,
        metadata=r.metadata or {}, user=r.user, store=r.store is not False, background=bool(r.background),
        safety_identifier=r.safety_identifier, prompt_cache_key=r.prompt_cache_key)


class FramerSpec(msgspec.Struct, omit_defaults=True):
    """What the framer needs beyond the core's PostprocSpec (its `dialect` bytes, msgpack)."""

    response: Response  # the response before output (its id is the request's id)
    first_sequence_number: int = 0  # background: the stored response.created is event 0
    seal_with: str = ""  # include asked for sealed reasoning: the state directory whose key seals it
    namespaces: dict[str, tuple[str, str]] = {}  # the name the model sees -> (namespace, function name)


# ---- stream events -----------------------------------------------------------

class ResponseEvent(msgspec.Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: Response


class ItemEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A text's delta or its whole (done) in an output_text / reasoning_text part, or a call's arguments."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int | msgspec.UnsetType = msgspec.UNSET  # (none for a call's arguments)
    delta: str | msgspec.UnsetType = msgspec.UNSET
    text: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str | msgspec.UnsetType = msgspec.UNSET
    logprobs: list[Any] | msgspec.UnsetType = msgspec.UNSET  # (output_text events carry an empty list)


class ErrorEvent(msgspec.Struct, kw_only=True):
    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None
    message: str
    param: str | None = None


Event = ResponseEvent | ItemEvent | PartEvent | TextEvent | ErrorEvent
_json = msgspec.json.Encoder()


def sse(event: Event) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + _json.encode(event) + b"\n\n"


# ---- what is stored of a response and its stream -------------------------------------------------------

class ResponseHead(msgspec.Struct):
    """What the state database keeps beside a response's JSON."""

    id: str
    status: Status
    created_at: int
    previous_response_id: str | None = None
    background: bool = False
