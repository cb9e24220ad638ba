"""Anthropic's context editing (the context-management-2025-06-27 beta), done before render: the edits of a
Messages request's `context_management` drop the named blocks of earlier turns from the prompt, and say what
they cleared (the response's `context_management.applied_edits`). The client keeps the whole conversation;
only the prompt the model reads is edited.

- clear_thinking_20251015: the thinking blocks of all but the last `keep` assistant turns go (an assistant
  turn: the assistant messages that answer one user prompt, its tool loop included).
- clear_tool_uses_20250919: once the prompt passes `trigger`, the results of all but the last `keep` tool
  uses (those of `exclude_tools` never) become a placeholder, and their inputs are emptied where
  `clear_tool_inputs` says; not at all where that clears fewer than `clear_at_least` tokens.

Token figures (the trigger, clear_at_least, cleared_input_tokens) count the text concerned with the model's
tokenizer, without the chat template's few tokens around it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from sluice.schemas.anthropic import (AllThinkingTurns, ClearedThinking, ClearedToolUses, ClearThinking, ClearToolUses,
                                      ContentBlock, ContextManagementResponse, InputTokens, MessageParam,
                                      MessagesRequest, RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolResultBlock,
                                      ToolUseBlock)

Counter = Callable[[str], int]  # a text's tokens, by the model's tokenizer
CLEARED_RESULT = "[this tool result was cleared to save context]"
DEFAULT_TRIGGER = InputTokens(100_000)
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1


@dataclass(frozen=True)
class Edited:
    messages: list[MessageParam]
    applied: ContextManagementResponse


def apply(request: MessagesRequest, count: Counter) -> Edited:
    """The request's messages after its edits, in their order, and what each edit that cleared anything
    cleared."""
    messages = list(request.messages)
    applied: list[ClearedThinking | ClearedToolUses] = []
    edits = request.context_management.edits if request.context_management else None
    for edit in edits or []:
        done: ClearedThinking | ClearedToolUses | None
        if isinstance(edit, ClearThinking):
            messages, done = _clear_thinking(messages, edit, count)
        elif isinstance(edit, ClearToolUses):
            messages, done = _clear_tool_uses(request, messages, edit, count)
        else:  # (compact_20260112 is refused as the body is decoded)
            continue
        if done is not None:
            applied.append(done)
    return Edited(messages, ContextManagementResponse(applied))


# ---- clear_thinking ------------------------------------------------------------------------------------------

def _clear_thinking(messages: list[MessageParam], edit: ClearThinking,
                    count: Counter) -> tuple[list[MessageParam], ClearedThinking | None]:
    keep = edit.keep
    if keep == "all" or isinstance(keep, AllThinkingTurns):
        return messages, None
    kept_turns = DEFAULT_KEEP_THINKING_TURNS if keep is None else keep.value
    turns = _assistant_turns(messages)
    older = turns[:max(len(turns) - kept_turns, 0)]
    out = list(messages)
    cleared_turns = tokens = 0
    for turn in older:
        cleared_here = False
        for i in turn:
            content = out[i].content
            if isinstance(content, str):
                continue
            kept = [b for b in content if not isinstance(b, (ThinkingBlock, RedactedThinkingBlock))]
            if len(kept) < len(content):
                cleared_here = True
                tokens += sum(count(b.thinking) for b in content if isinstance(b, ThinkingBlock))
                out[i] = msgspec.structs.replace(out[i], content=kept)
        cleared_turns += cleared_here
    if not cleared_turns:
        return messages, None
    return out, ClearedThinking(cleared_thinking_turns=cleared_turns, cleared_input_tokens=tokens)


def _assistant_turns(messages: Sequence[MessageParam]) -> list[list[int]]:
    """The indices of the assistant messages of each assistant turn, oldest first. A turn begins after a user
    message that says something (not one of only tool results, which continue the turn's tool loop)."""
    turns: list[list[int]] = []
    open_turn = False
    for i, m in enumerate(messages):
        if m.role == "user" and not _only_tool_results(m):
            open_turn = False
        elif m.role == "assistant":
            if not open_turn:
                turns.append([])
                open_turn = True
            turns[-1].append(i)
    return turns


def _only_tool_results(m: MessageParam) -> bool:
    return not isinstance(m.content, str) and bool(m.content) and all(
        isinstance(b, ToolResultBlock) for b in m.content)


# ---- clear_tool_uses -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Use:
    message: int  # where its tool_use block is
    block: int
    name: str
    input: dict
    result: tuple[int, int] | None  # where its tool_result block is, if sent


def _clear_tool_uses(request: MessagesRequest, messages: list[MessageParam], edit: ClearToolUses,
                     count: Counter) -> tuple[list[MessageParam], ClearedToolUses | None]:
    uses = _tool_uses(messages)
    trigger = edit.trigger or DEFAULT_TRIGGER
    if isinstance(trigger, InputTokens):
        if prompt_tokens(request, messages, count) <= trigger.value:
            return messages, None
    elif len(uses) <= trigger.value:
        return messages, None
    keep = DEFAULT_KEEP_TOOL_USES if edit.keep is None else edit.keep.value
    excluded = set(edit.exclude_tools or [])
    older = [u for u in uses[:max(len(uses) - keep, 0)] if u.name not in excluded]
    inputs = edit.clear_tool_inputs
    out = list(messages)
    blocks = {i: list(m.content) for i, m in enumerate(messages) if not isinstance(m.content, str)}
    cleared = tokens = 0
    for use in older:
        cleared_here = False
        if use.result is not None:
            i, j = use.result
            result = blocks[i][j]
            assert isinstance(result, ToolResultBlock)
            if result.content != CLEARED_RESULT:
                tokens += sum(count(t) for t in _result_texts(result))
                blocks[i][j] = msgspec.structs.replace(result, content=CLEARED_RESULT)
                cleared_here = True
        if (inputs is True or (isinstance(inputs, list) and use.name in inputs)) and use.input:
            call = blocks[use.message][use.block]
            assert isinstance(call, ToolUseBlock)
            tokens += count(json.dumps(call.input, ensure_ascii=False))
            blocks[use.message][use.block] = msgspec.structs.replace(call, input={})
            cleared_here = True
        cleared += cleared_here
    if not cleared or (edit.clear_at_least is not None and tokens < edit.clear_at_least.value):
        return messages, None
    for i, content in blocks.items():
        out[i] = msgspec.structs.replace(out[i], content=content)
    return out, ClearedToolUses(cleared_tool_uses=cleared, cleared_input_tokens=tokens)


def _tool_uses(messages: Sequence[MessageParam]) -> list[_Use]:
    """Every tool use of the assistant turns, oldest first, with where its result is."""
    results: dict[str, tuple[int, int]] = {}
    for i, m in enumerate(messages):
        if m.role == "user" and not isinstance(m.content, str):
            results.update({b.tool_use_id: (i, j) for j, b in enumerate(m.content) if isinstance(b, ToolResultBlock)})
    return [_Use(i, j, b.name, b.input, results.get(b.id))
            for i, m in enumerate(messages) if m.role == "assistant" and not isinstance(m.content, str)
            for j, b in enumerate(m.content) if isinstance(b, ToolUseBlock)]


def _result_texts(result: ToolResultBlock) -> list[str]:
    if isinstance(result.content, str):
        return [result.content]
    return [part.text for part in result.content if isinstance(part, TextBlock)]


def prompt_tokens(request: MessagesRequest, messages: Sequence[MessageParam], count: Counter) -> int:
    """The prompt's tokens as its texts count them: the system text, the tools' definitions, and every
    block of every message."""
    texts = [request.system] if isinstance(request.system, str) else [b.text for b in request.system or []]
    texts += [json.dumps([msgspec.to_builtins(t) for t in request.tools], ensure_ascii=False)] if request.tools else []
    for m in messages:
        texts += message_texts(m)
    return sum(count(t) for t in texts if t)


def message_texts(m: MessageParam) -> list[str]:
    return [m.content] if isinstance(m.content, str) else [t for b in m.content for t in _block_texts(b)]


def _block_texts(block: ContentBlock) -> list[str]:
    if isinstance(block, TextBlock):
        return [block.text]
    if isinstance(block, ThinkingBlock):
        return [block.thinking]
    if isinstance(block, ToolUseBlock):
        return [block.name, json.dumps(block.input, ensure_ascii=False)]
    if isinstance(block, ToolResultBlock):
        return _result_texts(block)
    return []
