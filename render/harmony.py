"""The gpt-oss serving extension: harmony rendering with openai-harmony, and
token-level parsing of the output (see postproc/harmony.py)."""
from __future__ import annotations

import json
from datetime import date
from typing import Literal

from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from ipc.messages import ParserName
from ipc.openai import ChatCompletionRequest
from render import tool_grammars
from render.extensions import (ExtensionOptions, HfChatTemplateExtension, Rendered, Unsupported, common_unsupported,
                               forced_tool, holds_tools, message_text, register, render_template)
from render.structured import Constraint
from render.tokenizer import PromptBudget, TokenizerBundle
from sluice.harmony_vocab import harmony_encoding

_EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
PARSER_ALIASES = {"gpt_oss", "openai_gptoss", "harmony"}


def harmony_messages(request: ChatCompletionRequest, today: str | None = None) -> list[Message]:
    """The conversation in harmony: system, developer (instructions and tools), then the turns."""
    system = SystemContent.new().with_reasoning_effort(_EFFORT[request.reasoning_effort or "medium"])
    system = system.with_conversation_start_date(today or date.today().isoformat())
    instructions = "\n\n".join(message_text(m) for m in request.messages if m.role in ("system", "developer"))
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        # harmony's place for a structured-output schema (the grammar enforces it; this tells the model)
        spec = fmt.json_schema
        described = f"// {spec.description}\n" if spec.description else ""
        section = f"# Response Formats\n\n## {spec.name}\n\n{described}{json.dumps(spec.schema)}"
        instructions = f"{instructions}\n\n{section}" if instructions else section
    tools = request.tools if request.tool_choice != "none" else None
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([
                ToolDescription.new(t.function.name, t.function.description or "", t.function.parameters)
                for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
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


@register("gpt_oss")
def gpt_oss_extension(bundle: TokenizerBundle, options: ExtensionOptions):
    return HarmonyExtension(bundle, options) if options.harmony else HfChatTemplateExtension(bundle, options)


class HarmonyExtension:
    output_mode: Literal["text", "tokens"] = "tokens"

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
            convo = Conversation.from_messages(harmony_messages(request))
            ids = self.enc.render_conversation_for_completion(convo, Role.ASSISTANT)
        prefix: list[int] = []
        if (tool := forced_tool(request)) is not None:  # the turn starts with the call to that function
            name = tool.function.name
            prefix = self.enc.encode(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                                     allowed_special="all")
        return Rendered(list(ids) + prefix, prefix)

    def extra_stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]:
        out = common_unsupported(request, self.options, True)
        if request.thinking_token_budget is not None:
            out.append(Unsupported("thinking_token_budget", "gpt-oss has no thinking budget; "
                                                            "use reasoning_effort (low, medium or high)",
                                   "thinking_token_budget"))
        if request.continue_final_message and request.chat_template is None:
            out.append(Unsupported("continue_final_message", "gpt-oss's harmony rendering cannot leave a message "
                                   "open", "continue_final_message"))
        return out

    def structured_output_format(self, request: ChatCompletionRequest) -> list[int]:
        # The answer, not the reasoning, is what must follow the format: the final channel.
        return self.enc.encode("<|channel|>final<|message|>", allowed_special="all")

    def tool_constraint(self, request: ChatCompletionRequest) -> Constraint | None:
        # Reasoning (the analysis channel) stays free; calls go through the commentary channel.
        if not holds_tools(request):
            return None
        if (tool := forced_tool(request)) is not None:
            return Constraint("lark", tool_grammars.harmony_named(tool), "tool_choice")
        if request.tool_choice == "required":
            return Constraint("lark", tool_grammars.harmony_required(request.tools or []), "tool_choice")
        return Constraint("lark", tool_grammars.harmony_strict(request.tools or []), "tools")

    def parsers(self) -> list[ParserName]:
        return ["harmony"]

    @staticmethod
    def check_options(options: ExtensionOptions) -> None:
        if not options.harmony:
            return HfChatTemplateExtension.check_options(options)
        for flag, value in (("--tool-parser", options.tool_parser), ("--reasoning-parser", options.reasoning_parser)):
            if value is not None and value not in PARSER_ALIASES:
                raise ValueError(f"{flag} {value!r} cannot apply to a gpt-oss model served with harmony; use gpt_oss "
                                 "(or --no-harmony to parse its text)")


gpt_oss_extension.check_options = HarmonyExtension.check_options
