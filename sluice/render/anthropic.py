"""The Anthropic Messages dialect's translation into the chat core's request.

Turns map onto the core's messages: system text (the top-level field, and any system turn in `messages`)
becomes one leading system message; a user turn's tool_result blocks become tool messages; an assistant
turn's thinking, text and tool_use blocks become its reasoning, content and tool calls. What the core cannot
do (images, server tools, prefilling the answer) is a 400 that says so.
"""
from __future__ import annotations

import json
from typing import Literal, Sequence

import msgspec

from sluice.render import context_edits
from sluice.render.context_edits import Counter
from sluice.render.diagnostics import Fingerprint, Part, digest
from sluice.render.errors import RequestError
from sluice.render.translators import Finish, Translation, translator
from sluice.schemas.anthropic import (CountTokensRequest, DocumentBlock, Framing, ImageBlock, MessageParam,
                                      MessagesRequest, RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolParam,
                                      ToolResultBlock, ToolUseBlock)
from sluice.schemas.openai import (ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall, FunctionDef,
                                   JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, Tool, ToolCall)

_decoder = msgspec.json.Decoder(MessagesRequest)
_framing = msgspec.msgpack.Encoder()
# Claude Code's first system block: a per-request attribution hash for Anthropic's billing, not for the model.
# Kept, it would change every prompt's first tokens and defeat the prefix cache.
_BILLING_HEADER = "x-anthropic-billing-header"
ERROR_PREFIX = "Error: "  # a tool_result with is_error, as the model reads it
ToolChoiceOut = Literal["none", "auto", "required"] | NamedToolChoice | None
_CHOICES: dict[str, ToolChoiceOut] = {"auto": "auto", "any": "required", "none": "none"}


@translator("messages")
def translate(body: bytes) -> Translation:
    request = _decoder.decode(body)
    if request.context_management is not None or request.diagnostics is not None:
        return Translation(to_chat(request), finish=lambda finish: _finished(request, finish))
    return Translation(to_chat(request), _framing.encode(_framing_of(request)))


def _framing_of(r: MessagesRequest) -> Framing:
    return Framing(omit_thinking=r.thinking is not None and r.thinking.display == "omitted")


def _finished(r: MessagesRequest, finish: Finish) -> Translation:
    """The translation of a request whose context edits and diagnostics need the model's token counts."""
    framing = _framing_of(r)
    if r.context_management is not None:
        edited = context_edits.apply(r, finish.count)
        r = msgspec.structs.replace(r, messages=edited.messages)
        framing.context_management = edited.applied
    if r.diagnostics is not None and finish.fingerprints is not None:
        framing.diagnostics = finish.fingerprints.compare_and_keep(
            finish.request_id, r.diagnostics.previous_message_id, fingerprint(r, finish.count))
    return Translation(to_chat(r), _framing.encode(framing))


def fingerprint(r: MessagesRequest, count: Counter) -> Fingerprint:
    """The prompt's parts as Anthropic lays them out (tools, system, messages), for diagnostics."""
    tools = [msgspec.to_builtins(t) for t in r.tools or []]
    tools_text = json.dumps(tools, ensure_ascii=False) if tools else ""
    system = "\n".join(p.text or "" for p in _system_parts(r))
    messages = [Part(digest(msgspec.to_builtins(m)), sum(count(t) for t in context_edits.message_texts(m) if t))
                for m in r.messages if m.role != "system"]
    other = digest(msgspec.to_builtins([r.thinking, r.tool_choice, r.output_config]))
    return Fingerprint(r.model, Part(digest(tools), count(tools_text) if tools_text else 0),
                       Part(digest(system), count(system) if system else 0), messages, other)


def to_chat(r: MessagesRequest) -> ChatCompletionRequest:
    tools = [_tool(i, t) for i, t in enumerate(r.tools or [])]
    tool_choice, parallel = _tool_choice(r, tools)
    return ChatCompletionRequest(
        model=r.model,
        messages=_messages(r),
        max_tokens=r.max_tokens,
        stop=r.stop_sequences,
        stream=r.stream,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        user=r.metadata.user_id if r.metadata else None,
        tools=tools or None,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        thinking_token_budget=_thinking_budget(r),
        chat_template_kwargs=r.chat_template_kwargs,
        **_output_config(r),
    )


def _thinking_budget(r: MessagesRequest) -> int | None:
    """The core's thinking budget: "enabled" sets one (the model's extension says whether it can keep it);
    "adaptive" and "disabled" set none (the model thinks as it does, its reasoning comes back as thinking)."""
    if r.thinking is None or r.thinking.type != "enabled":
        return None
    if r.thinking.budget_tokens is None:
        raise RequestError(400, "thinking of type 'enabled' needs budget_tokens", param="thinking.budget_tokens")
    return r.thinking.budget_tokens


def _messages(r: CountTokensRequest) -> list[ChatMessage]:
    system = _system_parts(r)
    out = [ChatMessage("system", system)] if system else []
    turns = [(i, m) for i, m in enumerate(r.messages) if m.role != "system"]
    if not turns:
        raise RequestError(400, "messages: at least one user message is required", param="messages")
    if turns[-1][1].role == "assistant":
        raise RequestError(400, "a last message with role 'assistant' (prefilling the answer) is not supported: "
                           "end with a user message", param=f"messages[{turns[-1][0]}]")
    for i, m in turns:
        out += _user(i, m) if m.role == "user" else [_assistant(i, m)]
    return out


def _system_parts(r: CountTokensRequest) -> list[ContentPart]:
    """Every system text in order: the `system` field, then the system turns in `messages`."""
    parts = _system_text(r.system, "system") if r.system else []
    for i, m in enumerate(r.messages):
        if m.role == "system":
            parts += _system_text(m.content, f"messages[{i}].content")
    return parts


def _system_text(content: str | Sequence[object], where: str) -> list[ContentPart]:
    parts = []
    for j, block in enumerate([TextBlock(content)] if isinstance(content, str) else content):
        if not isinstance(block, TextBlock):
            raise RequestError(400, f"system content takes text blocks only, not {_kind(block)!r}",
                               param=f"{where}[{j}]")
        if block.text and not block.text.startswith(_BILLING_HEADER):
            parts.append(ContentPart("text", block.text))
    return parts


def _user(i: int, m: MessageParam) -> list[ChatMessage]:
    """A user turn: its tool results as tool messages, its text as a user message, in the turn's order."""
    if isinstance(m.content, str):
        return [ChatMessage("user", m.content)]
    out: list[ChatMessage] = []
    text: list[ContentPart] = []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            text.append(ContentPart("text", block.text))
        elif isinstance(block, ToolResultBlock):
            if text:
                out.append(ChatMessage("user", text))
                text = []
            out.append(ChatMessage("tool", _tool_result(block, where), tool_call_id=block.tool_use_id))
        else:
            raise _unsupported(block, where, "a user turn")
    if text or not out:
        out.append(ChatMessage("user", text))
    return out


def _tool_result(block: ToolResultBlock, where: str) -> list[ContentPart]:
    items = [TextBlock(block.content)] if isinstance(block.content, str) else block.content
    parts = [ContentPart("text", ERROR_PREFIX)] if block.is_error else []
    for k, item in enumerate(items):
        if not isinstance(item, TextBlock):
            raise _unsupported(item, f"{where}.content[{k}]", "a tool_result")
        parts.append(ContentPart("text", item.text))
    return parts


def _assistant(i: int, m: MessageParam) -> ChatMessage:
    if isinstance(m.content, str):
        return ChatMessage("assistant", m.content)
    text: list[ContentPart] = []
    calls: list[ToolCall] = []
    reasoning = []
    for j, block in enumerate(m.content):
        if isinstance(block, TextBlock):
            text.append(ContentPart("text", block.text))
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(FunctionCall(block.name, json.dumps(block.input, ensure_ascii=False)), block.id))
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):  # (encrypted by Anthropic: nothing here can read it)
            raise _unsupported(block, f"messages[{i}].content[{j}]", "an assistant turn")
    return ChatMessage("assistant", text, tool_calls=calls or None, reasoning_content="".join(reasoning) or None)


def _unsupported(block: object, where: str, place: str) -> RequestError:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        return RequestError(400, f"{_kind(block)} blocks are not supported yet: this server takes text only",
                            param=where, code="unsupported_feature")
    return RequestError(400, f"a {_kind(block)!r} block cannot appear in {place}", param=where)


def _kind(block: object) -> str:
    return str(getattr(type(block), "__struct_config__").tag)


def _tool(i: int, t: ToolParam) -> Tool:
    if t.type != "custom":
        raise RequestError(400, f"tools[{i}]: tool type {t.type!r} is not supported: this server runs no tools of "
                           "its own; define a custom tool (name, description, input_schema)", param=f"tools[{i}]",
                           code="unsupported_feature")
    if t.input_schema is None:
        raise RequestError(400, f"tools[{i}].input_schema is required", param=f"tools[{i}].input_schema")
    return Tool(function=FunctionDef(t.name, t.description, t.input_schema, t.strict))


def _tool_choice(r: MessagesRequest, tools: list[Tool]) -> tuple[ToolChoiceOut, bool | None]:
    """The core's tool_choice and parallel_tool_calls."""
    choice = r.tool_choice
    if choice is None:
        return ("auto" if tools else None), None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if choice.name is None:
            raise RequestError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
        if choice.name not in {t.function.name for t in tools}:
            raise RequestError(400, f"tool_choice names {choice.name!r}, which is not among tools",
                               param="tool_choice.name")
        return NamedToolChoice(function=NamedFunction(choice.name)), parallel
    return _CHOICES[choice.type], parallel


def _output_config(r: MessagesRequest) -> dict:
    config = r.output_config
    if config is None:
        return {}
    out: dict = {}
    if config.effort is not None:  # (xhigh and max: the model's highest, ipc.openai.EFFORT_LEVEL)
        out["reasoning_effort"] = config.effort
    if config.format is not None:
        out["response_format"] = ResponseFormat("json_schema", JsonSchemaFormat("output", config.format.schema))
    return out
