"""The Responses API translated into the chat core's request (registered with render.dialects.translator).

Items become chat messages: a run of reasoning, assistant text and function calls is one assistant turn
(reasoning_content, content, tool_calls), a function_call_output a tool message. The stored conversation
that previous_response_id names comes with the job (RenderBody.history), read by whoever submitted it, so
the prompt begins with the earlier one and reuses its KV blocks through the prefix cache.
"""
from __future__ import annotations

import msgspec

from ipc.openai import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, JsonSchemaFormat, NamedFunction,
                        NamedToolChoice, ResponseFormat, Tool, ToolCall)
from ipc.responses import FramerSpec, InputItem, RenderBody, TextConfig, ToolChoiceFunction, new_response, text_of
from render.dialects import Translation, translator

_decoder = msgspec.json.Decoder(RenderBody)
_encoder = msgspec.msgpack.Encoder()


@translator("responses")
def translate(body: bytes) -> Translation:
    job = _decoder.decode(body)
    r = job.request
    chat = ChatCompletionRequest(
        model=r.model,
        messages=to_messages(r.instructions, job.history + r.items),
        tools=[Tool(function=FunctionDef(t.name, t.description, t.parameters, t.strict)) for t in r.tools or []]
        or None,
        tool_choice=_tool_choice(r.tool_choice),
        parallel_tool_calls=r.parallel_tool_calls,
        max_completion_tokens=r.max_output_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        reasoning_effort=r.reasoning.effort if r.reasoning else None,
        response_format=_response_format(r.text),
        chat_template_kwargs=r.chat_template_kwargs,
        stream=bool(r.stream or job.background),  # the background owner keeps every event
        user=r.user,
    )
    # (created_at 0: the framer takes the request's arrival time)
    framing = FramerSpec(new_response(r, "", job.created_at or 0, "in_progress"),
                         first_sequence_number=1 if job.background else 0)
    return Translation(chat, _encoder.encode(framing), truncate=r.truncation == "auto")


def to_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    names: dict[str, str] = {}  # call_id -> the function's name (a tool message names what it answers)
    for item in items:
        if item.type == "function_call_output":
            call_id = item.call_id or ""
            out.append(ChatMessage(role="tool", content=text_of(item.output), tool_call_id=call_id,
                                   name=names.get(call_id)))
        elif item.type == "message" and item.role != "assistant":
            assert item.role is not None  # (InputItem checked it)
            out.append(ChatMessage(role=item.role, content=text_of(item.content)))
        else:
            turn = _assistant_turn(out, item)
            if item.type == "reasoning":
                turn.reasoning_content = (turn.reasoning_content or "") + text_of(item.content)
            elif item.type == "message":
                turn.content = (turn.content if isinstance(turn.content, str) else "") + text_of(item.content)
            else:
                names[item.call_id or ""] = item.name or ""
                call = ToolCall(FunctionCall(item.name or "", item.arguments or ""), id=item.call_id)
                turn.tool_calls = (turn.tool_calls or []) + [call]
    return out


def _assistant_turn(out: list[ChatMessage], item: InputItem) -> ChatMessage:
    """The assistant message `item` belongs to: the last one, unless `item` begins a new step (reasoning or
    text after that message's text or calls)."""
    last = out[-1] if out else None
    if last is None or last.role != "assistant" or (item.type in ("reasoning", "message")
                                                    and (last.content or last.tool_calls)):
        out.append(ChatMessage(role="assistant"))
    return out[-1]


def _tool_choice(choice: str | ToolChoiceFunction | None):
    if isinstance(choice, ToolChoiceFunction):
        return NamedToolChoice(function=NamedFunction(choice.name))
    return choice


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name or "response", fmt.schema, fmt.description,
                                                          fmt.strict))
