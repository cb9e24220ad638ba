"""The Anthropic Messages dialect: request Structs (validated by the ingress, translated by the render pool),
the content blocks of requests and responses, and the Message Batches shapes.

Strict where Anthropic is strict: an unknown top-level field, or one in metadata, tool_choice, thinking or
output_config, is a 400 that names it. Every field of the SDK's create calls is decided in ipc/sdk_fields.py
(honoured, a hint, or refused with a 400 that says why; null is always unset). Lenient inside content blocks
and tool definitions, which clients send back with the extra fields the responses carried (citations,
cache_control, caller, ...).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluice.schemas import sdk_fields
from sluice.schemas.openai import INT32_MAX, PositiveInt

_STRICT = dict(forbid_unknown_fields=True, omit_defaults=True)


# ---- content blocks (requests and responses) ---------------------------------------------------------------

class CacheControl(msgspec.Struct, **_STRICT):
    """A prompt-caching breakpoint (the prefix cache here keeps every prefix: taken, and checked as Anthropic
    checks it)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(msgspec.Struct, tag="text", tag_field="type", omit_defaults=True):
    text: str
    cache_control: CacheControl | None = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", omit_defaults=True):
    source: Any = None
    cache_control: CacheControl | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type", omit_defaults=True):
    source: Any = None
    cache_control: CacheControl | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", omit_defaults=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ToolResultPart = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[ToolResultPart] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str = ""


ContentBlock = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                | RedactedThinkingBlock)
OutputBlock = TextBlock | ThinkingBlock | ToolUseBlock


# ---- requests ------------------------------------------------------------------------------------------------

class MessageParam(msgspec.Struct, forbid_unknown_fields=True):
    # "system" too: current Claude Code sends system turns inside messages
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolParam(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool definition. Lenient: Anthropic's own server tools (web search, code execution, ...) carry
    fields of their own; the translation refuses them by type, with a message that says so."""

    name: str
    type: str = "custom"
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct, **_STRICT):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, **_STRICT):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1024, le=INT32_MAX)] | None = None  # with "enabled"
    display: Literal["summarized", "omitted"] | None = None


class Metadata(msgspec.Struct, **_STRICT):
    user_id: str | None = None


class JsonOutputFormat(msgspec.Struct, **_STRICT):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, **_STRICT):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


# ---- context management (the context-management-2025-06-27 beta): edits of earlier turns before render ----

Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]


class InputTokens(msgspec.Struct, tag="input_tokens", tag_field="type", **_STRICT):
    value: Count


class ToolUses(msgspec.Struct, tag="tool_uses", tag_field="type", **_STRICT):
    value: Count


class ThinkingTurns(msgspec.Struct, tag="thinking_turns", tag_field="type", **_STRICT):
    value: Count


class AllThinkingTurns(msgspec.Struct, tag="all", tag_field="type", **_STRICT):
    pass


class ClearThinking(msgspec.Struct, tag="clear_thinking_20251015", tag_field="type", **_STRICT):
    """Thinking blocks of all but the last `keep` assistant turns are dropped (None: the last turn's kept)."""

    keep: Literal["all"] | AllThinkingTurns | ThinkingTurns | None = None


class ClearToolUses(msgspec.Struct, tag="clear_tool_uses_20250919", tag_field="type", **_STRICT):
    """Once the prompt passes `trigger` (None: 100,000 input tokens), the results of all but the last `keep`
    tool uses (None: 3) are replaced by a placeholder, and their inputs emptied where `clear_tool_inputs` says;
    only if that clears at least `clear_at_least` tokens."""

    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class Compact(msgspec.Struct, tag="compact_20260112", tag_field="type", **_STRICT):
    instructions: str | None = None
    pause_after_compaction: bool | None = None
    trigger: InputTokens | None = None

    def __post_init__(self) -> None:
        raise ValueError("compact_20260112: server-side compaction (a summary written by the model) is not run "
                         "here; clear_thinking_20251015 and clear_tool_uses_20250919 are")


ContextEdit = ClearThinking | ClearToolUses | Compact


class ContextManagement(msgspec.Struct, **_STRICT):
    edits: list[ContextEdit] | None = None

    def __post_init__(self) -> None:
        kinds = [type(e) for e in self.edits or []]
        if ClearThinking in kinds and kinds[0] is not ClearThinking:
            raise ValueError("clear_thinking_20251015 must be the first of the edits when others are sent")


class DiagnosticsParam(msgspec.Struct, forbid_unknown_fields=True):
    """Asks why the prompt cache could not reuse the prefix of the request that answered previous_message_id
    (null: this request's prompt is kept to compare the next one with)."""

    previous_message_id: str | None = None


_COUNT_REFUSALS = sdk_fields.refused_fields(sdk_fields.COUNT_TOKENS)
_MESSAGES_REFUSALS = sdk_fields.refused_fields(sdk_fields.MESSAGES)


class CountTokensRequest(msgspec.Struct, kw_only=True, **_STRICT):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: for a chat template that reads them
    # The rest of the SDK's fields: hints, and refusals (what ipc/sdk_fields.py says of each; null is unset).
    cache_control: CacheControl | None = None
    speed: str | None = None
    billing_policy: Any = None
    context_management: ContextManagement | None = None
    compaction: Any = None
    mcp_servers: list[Any] | None = None

    def __post_init__(self) -> None:
        sdk_fields.refuse(self, _COUNT_REFUSALS)


class MessagesRequest(CountTokensRequest, kw_only=True, **_STRICT):
    """POST /v1/messages: the prompt, and how to sample its answer."""

    max_tokens: PositiveInt
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # (one tier here: either is honoured)
    container: Any = None
    thread: Any = None
    diagnostics: DiagnosticsParam | None = None
    inference_geo: str | None = None
    fallbacks: Any = None
    fallback_credit_token: Any = None

    def __post_init__(self) -> None:
        sdk_fields.refuse(self, _MESSAGES_REFUSALS)


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_Invalid = msgspec.ValidationError


def check_conversation(request: CountTokensRequest) -> None:
    """What Anthropic's API refuses beyond the fields' types, refused as it does (msgspec.ValidationError: a 400
    naming the place), by the ingress: empty content but in a final assistant message, a tool_result whose
    tool_use is not in the turn before, tool names that repeat or are not [a-zA-Z0-9_-]{1,128} (its own server
    tools aside)."""
    messages, tools = request.messages, request.tools or []
    for k, tool in enumerate(tools):
        if tool.type == "custom" and not _TOOL_NAME.fullmatch(tool.name):
            raise _Invalid(f"tools.{k}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$' "
                           f"- at `$.tools[{k}].name`")
    if len({t.name for t in tools}) < len(tools):
        raise _Invalid("tools: Tool names must be unique. - at `$.tools`")
    asked: set[str] = set()  # the tool_use ids of the last assistant turn
    for i, m in enumerate(messages):
        if not m.content and not (i == len(messages) - 1 and m.role == "assistant"):
            raise _Invalid(f"messages.{i}: all messages must have non-empty content except for the optional final "
                           f"assistant message - at `$.messages[{i}].content`")
        if m.role == "system" or isinstance(m.content, str):
            asked = set() if m.role == "assistant" else asked
            continue
        for j, block in enumerate(m.content):
            if isinstance(block, ToolResultBlock) and (m.role != "user" or block.tool_use_id not in asked):
                raise _Invalid(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                               f"{block.tool_use_id}. Each `tool_result` block must have a corresponding `tool_use` "
                               f"block in the previous message. - at `$.messages[{i}].content[{j}]`")
        if m.role == "assistant":
            asked = {b.id for b in m.content if isinstance(b, ToolUseBlock)}


class Framing(msgspec.Struct, omit_defaults=True):
    """What the postproc framer needs beyond PostprocSpec (its `dialect` bytes)."""

    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks carry their signature only
    context_management: ContextManagementResponse | None = None  # what the request's edits cleared
    diagnostics: Diagnostics | None = None  # why the prefix cache missed (asked for with `diagnostics`)


# ---- responses -----------------------------------------------------------------------------------------------

class ClearedThinking(msgspec.Struct, tag="clear_thinking_20251015", tag_field="type"):
    cleared_thinking_turns: int
    cleared_input_tokens: int


class ClearedToolUses(msgspec.Struct, tag="clear_tool_uses_20250919", tag_field="type"):
    cleared_tool_uses: int
    cleared_input_tokens: int


class ContextManagementResponse(msgspec.Struct):
    applied_edits: list[ClearedThinking | ClearedToolUses]


class CacheMiss(msgspec.Struct, omit_defaults=True):
    """Why the prompt cache could not reuse the previous request's prefix: model_changed, system_changed,
    tools_changed or messages_changed (with the tokens it would have read), previous_message_not_found, or
    unavailable."""

    type: str
    cache_missed_input_tokens: int | None = None


class Diagnostics(msgspec.Struct):
    cache_miss_reason: CacheMiss | None


class Usage(msgspec.Struct):
    input_tokens: int  # those not read from the prefix cache
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    service_tier: Literal["standard"] = "standard"  # (as Anthropic says it: one tier here)


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[OutputBlock]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    context_management: ContextManagementResponse | None = None
    diagnostics: Diagnostics | None = None


class ErrorObject(msgspec.Struct):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: ErrorObject


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """Anthropic's error for a status (its error type says the kind; the message names the field at fault)."""
    kind = _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
        message = f"{param}: {message}"
    return ErrorResponse(error=ErrorObject(kind, message))


# ---- Message Batches -----------------------------------------------------------------------------------------

CustomId = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_BATCH_REQUESTS = 100_000


class BatchRequest(msgspec.Struct, **_STRICT):
    custom_id: CustomId
    params: msgspec.Raw  # a MessagesRequest, checked one by one (the errors name its index)


class BatchCreateRequest(msgspec.Struct, **_STRICT):
    requests: Annotated[list[BatchRequest], Meta(min_length=1, max_length=MAX_BATCH_REQUESTS)]


ProcessingStatus = Literal["in_progress", "canceling", "ended"]


class RequestCounts(msgspec.Struct):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message_batch"
    processing_status: ProcessingStatus
    request_counts: RequestCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None
    results_url: str | None


class BatchList(msgspec.Struct):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedBatch(msgspec.Struct):
    id: str
    type: str = "message_batch_deleted"
