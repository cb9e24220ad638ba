"""The gpt-oss serving extension: harmony rendering with openai-harmony, and
token-level parsing of the output (see postproc/harmony.py)."""
from __future__ import annotations

import json
from datetime import date
from functools import lru_cache
from typing import Literal

import msgspec
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, RenderOptions, Role,
                            SystemContent, ToolDescription)

from sluice.base.harmony_vocab import harmony_encoding
from sluice.ipc.messages import ParserName
from sluice.render import tool_grammars
from sluice.render.extensions import (ExtensionOptions, HfChatTemplateExtension, Rendered, ServingExtension,
                                      Unsupported, common_unsupported, forced_tool, holds_tools, message_text, register,
                                      render_template)
from sluice.render.structured import Constraint
from sluice.render.tokenizer import PromptBudget, TokenizerBundle
from sluice.schemas.openai import EFFORT_LEVEL, ChatCompletionRequest, Tool

_EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
PARSER_ALIASES = {"gpt_oss", "openai_gptoss", "harmony", "auto"}


def system_message(effort: str, today: str) -> Message:
    content = SystemContent.new().with_reasoning_effort(_EFFORT[EFFORT_LEVEL[effort]]).with_conversation_start_date(
        today)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_instructions(request: ChatCompletionRequest) -> str:
    """The system and developer messages' text, then any response-format schema."""
    instructions = "\n\n".join(message_text(m) for m in request.messages if m.role in ("system", "developer"))
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        # harmony's place for a structured-output schema (the grammar enforces it; this tells the model)
        spec = fmt.json_schema
        described = f"// {spec.description}\n" if spec.description else ""
        section = f"# Response Formats\n\n## {spec.name}\n\n{described}{json.dumps(spec.schema)}"
        instructions = f"{instructions}\n\n{section}" if instructions else section
    return instructions


def function_tools(request: ChatCompletionRequest) -> list[Tool]:
    return (request.tools or []) if request.tool_choice != "none" else []


def developer_message(instructions: str, tools: list[Tool]) -> Message | None:
    if not instructions and not tools:
        return None
    dev = DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([
            ToolDescription.new(t.function.name, t.function.description or "", t.function.parameters) for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def turn_messages(request: ChatCompletionRequest) -> list[Message]:
    """The user, assistant and tool turns (system and developer messages go to the developer message)."""
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for m in request.messages:
        if m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, message_text(m)))
        elif m.role == "assistant":
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in m.tool_calls or []:
                call_names[call.id or ""] = call.function.name
                out.append(Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
                           .with_channel("commentary").with_recipient(f"functions.{call.function.name}")
                           .with_content_type("<|constrain|>json"))
            if text := message_text(m):
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        elif m.role == "tool":
            name = call_names.get(m.tool_call_id or "") or m.name or "tool"
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), message_text(m))
                       .with_channel("commentary").with_recipient("assistant"))
    return out


def harmony_prompt_ids(request: ChatCompletionRequest, today: str | None = None) -> list[int]:
    """openai-harmony's `render_conversation_for_completion` of the conversation in harmony (system, developer:
    instructions and tools, then the turns), the system and developer messages' tokens cached. harmony renders
    each message on its own, and what it does to the turns (dropping analysis before the first final answer)
    looks only at assistant channels, which these two lack; the one thing that crosses messages is the system
    message's line on function tools."""
    tools = function_tools(request)
    head = _system_ids(request.reasoning_effort or "medium", today or date.today().isoformat(), bool(tools))
    head += _developer_ids(developer_instructions(request), msgspec.json.encode(tools))
    if all(m.role in ("system", "developer", "user") for m in request.messages):
        return [*head, *_user_turn_ids(request)]
    convo = Conversation.from_messages(turn_messages(request))
    return [*head, *harmony_encoding().render_conversation_for_completion(convo, Role.ASSISTANT)]


def _user_turn_ids(request: ChatCompletionRequest) -> list[int]:
    """harmony's render of user turns alone (most requests): each is `<|start|>user<|message|>`, its text
    encoded as ordinary text, `<|end|>`, and the completion opens `<|start|>assistant`. harmony's own
    render rebuilds its special-token tables at every call, which cost it more than encoding the text."""
    enc = harmony_encoding()
    ids: list[int] = []
    for m in request.messages:
        if m.role == "user":
            ids += _special_ids("<|start|>user<|message|>")
            ids += enc.encode(message_text(m), disallowed_special=())  # special tokens' text is plain text here
            ids += _special_ids("<|end|>")
    return ids + list(_special_ids("<|start|>assistant"))


@lru_cache(maxsize=16)  # keyed on the date, so a past day's entries fall out
def _system_ids(effort: str, today: str, has_function_tools: bool) -> tuple[int, ...]:
    options = RenderOptions(conversation_has_function_tools=has_function_tools)
    return tuple(harmony_encoding().render(system_message(effort, today), options))


@lru_cache(maxsize=64)
def _developer_ids(instructions: str, tools_json: bytes) -> tuple[int, ...]:
    message = developer_message(instructions, msgspec.json.decode(tools_json, type=list[Tool]))
    return tuple(harmony_encoding().render(message)) if message else ()


@lru_cache(maxsize=64)
def _special_ids(text: str) -> tuple[int, ...]:
    # encode(allowed_special="all") hands every special token of the encoding to Rust at each call
    return tuple(harmony_encoding().encode(text, allowed_special="all"))


@register("gpt_oss")
def gpt_oss_extension(options: ExtensionOptions) -> type[ServingExtension]:
    return HarmonyExtension if options.harmony else HfChatTemplateExtension


class HarmonyExtension:
    output_mode: Literal["text", "tokens"] = "tokens"
    post_processor_hook_refusal: str | None = (
        "a gpt-oss model served through harmony: its output is parsed from the token ids, so a hook on the text "
        "would be bypassed; drop the hook, or serve the model as text with --no-harmony")

    def __init__(self, bundle: TokenizerBundle, options: ExtensionOptions) -> None:
        self.bundle = bundle
        self.options = options
        self.enc = harmony_encoding()
        # <|return|>, <|call|>: once (the encoding builds them afresh at each call)
        self._stops = tuple(self.enc.stop_tokens_for_assistant_actions())

    def render_prompt(self, request: ChatCompletionRequest, budget: PromptBudget) -> Rendered:
        if request.chat_template is not None:  # allowed only with --trust-request-chat-template
            text = render_template(request.chat_template, request, self.bundle, request.tools, budget)
            ids = self.enc.encode(text, allowed_special="all")
        else:
            ids = harmony_prompt_ids(request)
        prefix: list[int] = []
        if (tool := forced_tool(request)) is not None:  # the turn starts with the call to that function
            name = tool.function.name
            prefix = list(_special_ids(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"))
        return Rendered(ids + prefix, prefix)

    def extra_stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]:
        out = common_unsupported(request, self.options, True)
        if request.thinking_token_budget is not None:
            out.append(Unsupported("thinking_token_budget", "gpt-oss has no thinking budget; "
                                                            "use reasoning_effort (low, medium or high)",
                                   "thinking_token_budget"))
        if request.chat_template_kwargs and request.chat_template is None:
            out.append(Unsupported("chat_template_kwargs", "gpt-oss is rendered by harmony, not a chat template: "
                                   "there is no template to read them", "chat_template_kwargs"))
        if request.continue_final_message and request.chat_template is None:
            out.append(Unsupported("continue_final_message", "gpt-oss's harmony rendering cannot leave a message "
                                   "open", "continue_final_message"))
        return out

    def structured_output_format(self, request: ChatCompletionRequest) -> list[int]:
        # The answer, not the reasoning, is what must follow the format: the final channel.
        return list(_special_ids("<|channel|>final<|message|>"))

    def thinking_constraint(self, request: ChatCompletionRequest, prefix: list[int]) -> Constraint | None:
        return None  # (a budget is refused: unsupported_features)

    def tool_constraint(self, request: ChatCompletionRequest) -> Constraint | None:
        # Reasoning (the analysis channel) stays free; calls go through the commentary channel.
        if not holds_tools(request):
            return None
        if (tool := forced_tool(request)) is not None:
            return Constraint("lark", tool_grammars.harmony_named(tool), "tools")
        if request.tool_choice == "required":
            return Constraint("lark", tool_grammars.harmony_required(request.tools or []), "tools")
        return Constraint("lark", tool_grammars.harmony_strict(request.tools or []), "tools")

    def parsers(self) -> list[ParserName]:
        return ["harmony"]

    @staticmethod
    def check_options(options: ExtensionOptions) -> None:
        for flag, value in (("--tool-parser", options.tool_parser), ("--reasoning-parser", options.reasoning_parser)):
            if value is not None and value not in PARSER_ALIASES:
                raise ValueError(f"{flag} {value!r} cannot apply to a gpt-oss model served with harmony; use gpt_oss "
                                 "(or --no-harmony to parse its text)")

