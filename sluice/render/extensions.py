"""Serving extensions: everything model-specific the chat core asks about.

One chat core serves every model; a model family that renders or parses
differently adds an extension (chosen from the checkpoint's model_type through
the registry), never a branch in the core.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, cast

import msgspec

from sluice.base import tool_formats
from sluice.base.tool_formats import AUTO, REASONING_PARSERS, TOOL_PARSERS
from sluice.ipc.messages import ParserName
from sluice.render import thinking, tool_grammars
from sluice.render.chat_template import ChatTemplateError, TemplateOutputTooLong, render_chat
from sluice.render.errors import RequestError
from sluice.render.structured import Constraint
from sluice.render.tokenizer import PromptBudget, TokenizerBundle
from sluice.schemas.openai import EFFORT_LEVEL, ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

log = logging.getLogger("sluice.render")


@dataclass(frozen=True)
class ExtensionOptions:
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    harmony: bool = True  # gpt-oss: harmony rendering and token parsing (False: its HF chat template as text)
    trust_request_chat_template: bool = False


@dataclass(frozen=True)
class Rendered:
    prompt_ids: list[int]
    # The prompt's last tokens that already belong to the assistant's output (a forced tool call):
    # the output parsers read them first.
    output_prefix: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Unsupported:
    feature: str  # a stable name, e.g. "multimodal_input"
    message: str  # what to do instead
    param: str | None = None  # the request field that asks for it


class ServingExtension(Protocol):
    output_mode: Literal["text", "tokens"]  # "text": parse detokenized text; "tokens": parse token ids
    # why --post-processor-hook (which sees the detokenized text) cannot apply to this model; None: it can
    post_processor_hook_refusal: str | None

    def __init__(self, bundle: TokenizerBundle, options: ExtensionOptions) -> None: ...

    @staticmethod
    def check_options(options: ExtensionOptions) -> None:
        """Startup check: ValueError where a parser named in `options` cannot apply to this model."""
        ...

    def render_prompt(self, request: ChatCompletionRequest, budget: PromptBudget) -> Rendered:
        """The prompt's ids; a context-length RequestError as soon as it is clear they cannot fit `budget`."""
        ...

    def extra_stop_token_ids(self) -> tuple[int, ...]: ...

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]: ...

    def structured_output_format(self, request: ChatCompletionRequest) -> list[int]:
        """Where a response_format constraint starts: once the output ends with these ids ([]: at once)."""
        ...

    def tool_constraint(self, request: ChatCompletionRequest) -> Constraint | None:
        """The grammar, in this model's call format, for tool calls that must be made (tool_choice required or a
        named function) or held to their schemas (strict tools); None when neither applies."""
        ...

    def thinking_constraint(self, request: ChatCompletionRequest, prefix: list[int]) -> Constraint | None:
        """The grammar that holds the request's thinking_token_budget (None without one); `prefix`: the prompt's
        ids that begin the output (render_prompt's)."""
        ...

    def parsers(self) -> list[ParserName]:
        """The chat output parsers, in order (e.g. ["think", "hermes"] or ["harmony"])."""
        ...


# model_type -> which extension serves it under the options given
_REGISTRY: dict[str, Callable[[ExtensionOptions], type[ServingExtension]]] = {}


def register(*model_types: str):
    def deco(choose: Callable[[ExtensionOptions], type[ServingExtension]]):
        for t in model_types:
            _REGISTRY[t] = choose
        return choose
    return deco


def extension_class(hf_config: dict, options: ExtensionOptions) -> type[ServingExtension]:
    """The extension that serves this checkpoint under `options` (its class: what it says of itself, such as
    `output_mode`, is known before a tokenizer is loaded)."""
    import sluice.render.harmony  # noqa: F401  (registers the gpt-oss extension)

    choose = _REGISTRY.get(hf_config.get("model_type", ""))
    return choose(options) if choose is not None else HfChatTemplateExtension


def extension_for(hf_config: dict, bundle: TokenizerBundle, options: ExtensionOptions) -> ServingExtension:
    return extension_class(hf_config, options)(bundle, options)


def options_of(cfg) -> ExtensionOptions:
    """The extension options in a ServerConfig."""
    return ExtensionOptions(cfg.tool_parser, cfg.reasoning_parser, cfg.harmony, cfg.trust_request_chat_template)


def check_parsers(hf_config: dict, options: ExtensionOptions) -> None:
    """Startup check: a parser that cannot apply to this model is an error, not a silent no-op."""
    extension_class(hf_config, options).check_options(options)


def message_text(m: ChatMessage) -> str:
    if isinstance(m.content, list):
        return "".join(p.text or "" for p in m.content if p.type == "text")
    return m.content or ""


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d = msgspec.to_builtins(m)
    d["content"] = message_text(m) if isinstance(m.content, list) else m.content
    if m.reasoning is not None and m.reasoning_content is None:
        d["reasoning_content"] = d.pop("reasoning")
    for call in d.get("tool_calls") or []:
        fn = call["function"]
        try:  # templates expect arguments as an object, the wire carries a JSON string
            fn["arguments"] = json.loads(fn.get("arguments", "{}"))  # (left out on the wire where it is "{}")
        except (ValueError, TypeError, RecursionError):
            pass
    return d


def common_unsupported(request: ChatCompletionRequest, options: ExtensionOptions,
                       reasoning: bool) -> list[Unsupported]:
    """`reasoning`: whether the model's output is parsed into reasoning and answer."""
    out = []
    if any(isinstance(m.content, list) and any(p.type != "text" for p in m.content) for m in request.messages):
        out.append(Unsupported("multimodal_input", "this model takes text only; send content parts of type 'text'",
                               "messages"))
    for name, value, what in (("separate_reasoning", request.separate_reasoning, "kept apart"),
                              ("stream_reasoning", request.stream_reasoning, "streamed")):
        if not value and reasoning:
            out.append(Unsupported(name, f"this server's reasoning is always {what}", name))
    if request.return_hidden_states:
        out.append(Unsupported("return_hidden_states", "this server does not return hidden states",
                               "return_hidden_states"))
    if request.chat_template is not None and not options.trust_request_chat_template:
        out.append(Unsupported("request_chat_template", "start the server with --trust-request-chat-template to "
                                                        "allow a chat_template in requests", "chat_template"))
    return out


def forced_tool(request: ChatCompletionRequest) -> Tool | None:
    """The tool a named tool_choice forces (the core has checked that `tools` has it)."""
    choice = request.tool_choice
    if not isinstance(choice, NamedToolChoice):
        return None
    return next(t for t in request.tools or [] if t.function.name == choice.function.name)


def holds_tools(request: ChatCompletionRequest) -> bool:
    """Whether the request's tool calls are forced (required, a named function) or held to strict schemas."""
    forced = request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
    return bool(request.tools) and (forced or (request.tool_choice != "none"
                                               and any(t.function.strict for t in request.tools or [])))


def render_template(template: str, request: ChatCompletionRequest, bundle: TokenizerBundle, tools: list | None,
                    budget: PromptBudget) -> str:
    """The chat template's text; a 400 naming the template's source (the request's chat_template, or the
    messages the server's template failed on) when it fails, and a context-length error when its text is
    longer than any prompt that fits."""
    context = {
        **bundle.special_tokens,
        "tools": [msgspec.to_builtins(t) for t in tools] if tools else None,
        "add_generation_prompt": request.add_generation_prompt,
        **({"reasoning_effort": EFFORT_LEVEL[request.reasoning_effort]} if request.reasoning_effort else {}),
        **(request.chat_template_kwargs or {}),  # over the defaults above, as in vLLM
        "messages": [_message_dict(m) for m in request.messages],
    }
    if request.continue_final_message and request.add_generation_prompt:
        raise RequestError(400, "continue_final_message and add_generation_prompt cannot both be true: set "
                                "add_generation_prompt to false to continue the final message",
                           param="continue_final_message")
    try:
        text = render_chat(template, context, budget.max_chars)
    except TemplateOutputTooLong as e:
        raise budget.too_long(e.chars) from None
    except ChatTemplateError as e:
        raise RequestError(400, str(e), param="messages" if request.chat_template is None else "chat_template") from e
    return _open_final_message(text, request.messages[-1]) if request.continue_final_message else text


def _open_final_message(text: str, final: ChatMessage) -> str:
    """The rendered chat cut right after the final message's content (what follows it, the template's end
    of turn, goes), as transformers' continue_final_message does: the output continues that message."""
    content = message_text(final)
    loc = text.rfind(content.strip()) if content.strip() else -1
    if loc < 0:
        raise RequestError(400, "continue_final_message needs a final message with text that the chat template "
                                "renders", param="messages")
    body = content.lstrip()
    return text[: loc + (len(body) if text.startswith(body, loc) else len(content.strip()))]


def resolved_parsers(options: ExtensionOptions, template: str | None) -> tuple[str | None, str | None]:
    """The tool and reasoning parsers, `auto` chosen from the chat template (and said in the log)."""
    tool, reasoning = options.tool_parser, options.reasoning_parser
    for flag, value, choose in (("--tool-parser", tool, tool_formats.tool_parser_of),
                                ("--reasoning-parser", reasoning, tool_formats.reasoning_parser_of)):
        if value == AUTO:
            chosen = choose(template)
            log.info("%s auto: %s", flag, f"{chosen} (from the chat template)" if chosen else
                     "none (the chat template names no format, or more than one)")
            tool, reasoning = (chosen, reasoning) if flag == "--tool-parser" else (tool, chosen)
    return tool, reasoning


def _opened_reasoning(prompt: str) -> str:
    """The `<think>` (and the whitespace after it) that ends a rendered prompt, or ""."""
    at = prompt.rfind("<think>")
    return prompt[at:] if at >= 0 and not prompt[at + len("<think>"):].strip() else ""


class HfChatTemplateExtension:
    """Any model with a Hugging Face chat template; output parsed as text."""

    output_mode: Literal["text", "tokens"] = "text"
    post_processor_hook_refusal: str | None = None

    def __init__(self, bundle: TokenizerBundle, options: ExtensionOptions) -> None:
        self.bundle = bundle
        self.tool_parser, self.reasoning_parser = resolved_parsers(options, bundle.chat_template)
        self.options = options
        self.call_format = tool_grammars.ALL_FORMATS.get(self.tool_parser or "")
        self._added = _syntax_tokens(bundle)

    @staticmethod
    def check_options(options: ExtensionOptions) -> None:
        for flag, value, names in (("--tool-parser", options.tool_parser, TOOL_PARSERS),
                                   ("--reasoning-parser", options.reasoning_parser, REASONING_PARSERS)):
            if value is not None and value not in (*names, AUTO):
                raise ValueError(f"{flag} {value!r} cannot apply to this model; choose from {[*names, AUTO]}")

    def render_prompt(self, request: ChatCompletionRequest, budget: PromptBudget) -> Rendered:
        template = request.chat_template or self.bundle.chat_template
        if template is None:
            raise RequestError(400, "this model has no chat template; use /v1/completions", param="messages")
        tools = request.tools if request.tool_choice != "none" else None
        text = render_template(template, request, self.bundle, tools, budget)
        prefix = ""
        if (tool := forced_tool(request)) is not None and self.call_format is not None:  # start the turn with that call
            # (deepseek_r1 reads all before `</think>` as reasoning: the forced turn closes the block first)
            closed = "</think>\n\n" if self.reasoning_parser == "deepseek_r1" else ""
            prefix = closed + self.call_format.forced_prefix(tool.function.name)
        elif self.reasoning_parser in ("think", "qwen3") and (opened := _opened_reasoning(text)):
            # The template opened the reasoning block itself (DeepSeek-R1's, Qwen3 thinking models'): the model
            # never writes <think>, so the parsers read the opening first and what comes before </think> is
            # reasoning.
            text, prefix = text[:-len(opened)], opened
        tokenizer = self.bundle.tokenizer
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False).ids if prefix else []
        return Rendered(budget.encode(tokenizer, text, add_special_tokens=False) + prefix_ids, prefix_ids)

    def extra_stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def unsupported_features(self, request: ChatCompletionRequest) -> list[Unsupported]:
        out = common_unsupported(request, self.options, self.reasoning_parser is not None)
        if request.thinking_token_budget is not None and \
                (why := thinking.refusal(self.reasoning_parser, self._added)) is not None:
            out.append(Unsupported("thinking_token_budget", why, "thinking_token_budget"))
        if holds_tools(request) and self.call_format is None:
            forced = request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
            what = "forcing a call (tool_choice required or a named function)" if forced else "strict tools"
            if self.tool_parser is None:
                message = (f"{what} needs a tool parser on this model: start the server with --tool-parser hermes "
                           f"(or another of {sorted(tool_grammars.ALL_FORMATS)})")
            else:
                message = (f"{what} cannot be held in the {self.tool_parser} call format; send tool_choice auto "
                           "and tools without strict")
            out.append(Unsupported("forced_or_strict_tools", message, "tool_choice" if forced else "tools"))
        return out

    def structured_output_format(self, request: ChatCompletionRequest) -> list[int]:
        return []

    def tool_constraint(self, request: ChatCompletionRequest) -> Constraint | None:
        fmt = self.call_format
        if not holds_tools(request) or fmt is None:  # (None: unsupported_features has said so)
            return None
        tools, lit = request.tools or [], self._literal
        try:
            if (tool := forced_tool(request)) is not None:
                lark = tool_grammars.named(fmt, tool, lit)
            elif request.tool_choice == "required":
                parallel = request.parallel_tool_calls is not False
                lark = tool_grammars.required(fmt, tools, lit, parallel, self.reasoning_parser)
            else:
                lark = tool_grammars.strict(fmt, tools, lit)
        except tool_grammars.Unholdable as e:
            raise RequestError(400, f"tools: {e} in the {self.tool_parser} call format", param="tools") from None
        return Constraint("lark", lark, "tools")

    def thinking_constraint(self, request: ChatCompletionRequest, prefix: list[int]) -> Constraint | None:
        if request.thinking_token_budget is None:  # (one that cannot be held: unsupported_features said so)
            return None
        from_start = self.reasoning_parser == "deepseek_r1" or self._added[thinking.OPEN] in prefix
        return Constraint("lark", thinking.budget_grammar(request.thinking_token_budget, self._added, from_start),
                          "thinking_token_budget")

    def _literal(self, text: str) -> str:
        """Call syntax as grammar terminals: each token of the vocabulary's own (`<tool_call>` in Qwen's,
        `[TOOL_CALLS]` in Mistral's) by its id, which no text can spell; the text between as text."""
        added = self._added
        pieces = re.split("(" + "|".join(map(re.escape, added)) + ")", text) if added else [text]
        return " ".join(f"<[{added[p]}]>" if p in added else json.dumps(p) for p in pieces if p)

    def parsers(self) -> list[ParserName]:
        # (check_options admitted only parser names)
        return [cast(ParserName, p) for p in (self.reasoning_parser, self.tool_parser) if p]


def _syntax_tokens(bundle: TokenizerBundle) -> dict[str, int]:
    """The vocabulary's own tokens that the call formats' syntax uses (longest first, so that a split on them
    takes the longest)."""
    syntax = "".join(f.syntax() for f in tool_grammars.ALL_FORMATS.values()) + "<think></think>"
    found = {t.content: i for i, t in bundle.tokenizer.get_added_tokens_decoder().items()
             if len(t.content) > 1 and t.content in syntax}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def tool_param_types(request: ChatCompletionRequest, parsers: list[ParserName]) -> dict[str, dict[str, str]]:
    """Each tool's parameters' JSON-schema types, for a tool parser whose arguments are text (qwen3_coder)."""
    if "qwen3_coder" not in parsers or not request.tools:
        return {}
    return {t.function.name: {k: _schema_type(v) for k, v in
                              ((t.function.parameters or {}).get("properties") or {}).items()}
            for t in request.tools}


def _schema_type(schema: Any) -> str:
    """A parameter's JSON-schema type (of a list, the first that is not null; "string" when it names none)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return kind if isinstance(kind, str) else "string"
