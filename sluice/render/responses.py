"""The Responses API translated into the chat core's request (registered with translators.translator).

Items become chat messages: a run of reasoning, assistant text and function calls is one assistant turn
(reasoning_content, content, tool_calls), a function_call_output a tool message. The stored conversation
that previous_response_id names comes with the job (RenderBody.history), read by whoever submitted it, so
the prompt begins with the earlier one and reuses its KV blocks through the prefix cache.

A namespace tool's functions are offered as functions, each under its flat name (sluice.schemas.responses.flat_name); a
call to one comes back under its own name with its namespace (FramerSpec.namespaces). Reasoning sealed by this
server (encrypted_content) is opened here and rendered as the plain reasoning it was.
"""
from __future__ import annotations

from typing import Callable

import msgspec

from sluice.base import sealing
from sluice.render.errors import RequestError
from sluice.render.translators import Translation, translator
from sluice.schemas.openai import (ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, JsonSchemaFormat,
                                   NamedFunction, NamedToolChoice, ResponseFormat, Tool, ToolCall)
from sluice.schemas.responses import (FramerSpec, InputItem, Part, RenderBody, TextConfig, ToolChoiceFunction,
                                      new_response, text_of)
from sluice.schemas.responses_tools import flat_name, functions

_decoder = msgspec.json.Decoder(RenderBody)
_encoder = msgspec.msgpack.Encoder()


@translator("responses")
def translate(body: bytes) -> Translation:
    job = _decoder.decode(body)
    r = job.request
    history = _opened(job.history, job.state_dir, lambda i: "previous_response_id")
    items = _opened(r.items, job.state_dir, lambda i: f"input[{i}].encrypted_content")
    offered = functions(r.tools)
    chat = ChatCompletionRequest(
        model=r.model,
        messages=to_messages(r.instructions, history + items),
        tools=[Tool(function=FunctionDef(flat_name(ns, t.name) if ns else t.name, t.description, t.parameters,
                                         t.strict)) for ns, t in offered] or None,
        tool_choice=_tool_choice(r.tool_choice),
        parallel_tool_calls=r.parallel_tool_calls,
        max_completion_tokens=r.max_output_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        reasoning_effort=r.reasoning.effort if r.reasoning else None,
        response_format=_response_format(r.text),
        chat_template_kwargs=r.chat_template_kwargs,
        stream=bool(r.stream or job.background),  # the background owner keeps every event
        store=r.store is not False or job.background,  # (the last frame carries the finished response: Frame.stored)
        user=r.user,
    )
    # (created_at 0: the framer takes the request's arrival time)
    framing = FramerSpec(new_response(r, "", job.created_at or 0, "in_progress"),
                         first_sequence_number=1 if job.background else 0,
                         seal_with=job.state_dir if r.sealed_reasoning else "",
                         namespaces={flat_name(ns, t.name): (ns, t.name) for ns, t in offered if ns})
    return Translation(chat, _encoder.encode(framing), truncate=r.truncation == "auto")


def _opened(items: list[InputItem], state_dir: str, param: Callable[[int], str]) -> list[InputItem]:
    """The items with each sealed reasoning opened: its text as the item's content (what this server sealed
    is what the model reasoned, whatever plain content came beside it)."""
    return [msgspec.structs.replace(item, content=[Part("reasoning_text", _open(item.encrypted_content, state_dir,
                                                                                 param(i)))], encrypted_content=None)
            if item.encrypted_content else item for i, item in enumerate(items)]


def _open(blob: str, state_dir: str, param: str) -> str:
    """A blob this server did not seal, or one altered, is a 400 naming where it came from."""
    if not state_dir:  # (a router that renders to hash the prompt holds no key: the worker opens it)
        raise RequestError(400, f"{param}: sealed reasoning opens only on the server that sealed it", param=param)
    try:
        return sealing.sealer(state_dir).open(blob)
    except sealing.Unsealable as e:
        raise RequestError(400, f"{param} is not reasoning this server sealed ({e}): send reasoning items back as "
                           "this server returned them", param=param) from None
    except OSError as e:
        raise RequestError(500, f"the reasoning key under --state-dir could not be read: {e}",
                           code="state_unavailable") from None


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
                name = flat_name(item.namespace, item.name or "") if item.namespace else item.name or ""
                names[item.call_id or ""] = name
                call = ToolCall(FunctionCall(name, item.arguments or ""), id=item.call_id)
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
