"""What Sluice does with every parameter of the official SDKs' create calls: one table per route, covering each
SDK method that posts to it (openai and anthropic, at the versions pinned in pyproject's `test` extras).

The route's request Struct declares each body field of its table and refuses, as it is decoded, what the table
refuses (`refuse`); tests/ipc/test_sdk_fields.py fails on an SDK parameter that is in no table, so a new SDK
release shows up as a failing test naming the field. A null is "not set", for every field.

- honoured: it does what the API documents.
- hint: taken, and it changes nothing this server could do differently (the note says why, and where the
  response echoes it as the real API does).
- refused: a value other than null (or one `accepts` lets through, that asks for what this server does anyway)
  is a 400 naming the field, the note its reason: it would change the output in a way this server cannot.
- client: never reaches the body (the SDK's own options, or a header).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

Kind = Literal["honoured", "hint", "refused", "client"]


def _empty(value: Any) -> bool:
    return not value


def _never(value: Any) -> bool:
    return False  # (an empty object asks for the feature with its defaults)


@dataclass(frozen=True)
class Decision:
    kind: Kind
    note: str = ""
    accepts: Callable[[Any], bool] = _empty  # refused: the values taken anyway (beside null)


def honoured(note: str = "") -> Decision:
    return Decision("honoured", note)


def hint(note: str) -> Decision:
    return Decision("hint", note)


def refused(note: str, accepts: Callable[[Any], bool] = _empty) -> Decision:
    return Decision("refused", note, accepts)


def client(note: str) -> Decision:
    return Decision("client", note)


Table = dict[str, Decision]

_SDK_OPTIONS: Table = {
    "extra_headers": client("the SDK's: sent as headers"),
    "extra_query": client("the SDK's: sent in the query string"),
    "extra_body": client("the SDK's: merged into the body, where each field is decided as if sent directly"),
    "timeout": client("the SDK's own timeout"),
}
_ONE_TIER = "one tier here: every request is served alike"
_CACHE = "the prefix cache keeps every prompt prefix that fits, by its tokens: nothing to key, mark or retain"
_AFFINITY = ("`sluice router`'s affinity key: requests with one key go to one replica wherever its cache and load "
             "leave a choice (one server keeps every prefix by its tokens anyway)")
_NO_MODERATION = "no moderation model runs here"
_ANTHROPIC_HEADERS: Table = {
    "user_profile_id": client("sent as the anthropic-user-profile-id header: one user profile here"),
    "workspace_id": client("sent as the anthropic-workspace-id header: one workspace here"),
    "betas": client("sent as the anthropic-beta header: the fields a beta adds are decided in this table"),
}

_SAMPLING: Table = {
    "model": honoured(),
    "frequency_penalty": honoured(),
    "presence_penalty": honoured(),
    "logit_bias": honoured(),
    "max_tokens": honoured(),
    "n": honoured(),
    "seed": honoured(),
    "stop": honoured(),
    "stream": honoured(),
    "stream_options": honoured("include_usage; include_obfuscation is taken and adds no padding"),
    "temperature": honoured(),
    "top_p": honoured(),
    "user": honoured("the end user named in the request's log line"),
}

CHAT_COMPLETIONS: Table = {
    **_SAMPLING, **_SDK_OPTIONS,
    "messages": honoured(),
    "max_completion_tokens": honoured(),
    "logprobs": honoured(),
    "top_logprobs": honoured(),
    "parallel_tool_calls": honoured(),
    "reasoning_effort": honoured("where the model's extension takes an effort: low, medium and high; none and "
                                 "minimal as low, xhigh and max as high (gpt-oss knows three levels)"),
    "response_format": honoured(),
    "tool_choice": honoured("function tools"),
    "tools": honoured("function tools"),
    "audio": refused("audio output is not generated here: this server answers in text"),
    "modalities": refused("this server answers in text: send ['text'] or leave it out",
                          accepts=lambda v: not v or list(v) == ["text"]),
    "functions": refused("the legacy functions are not taken: send them as tools"),
    "function_call": refused("the legacy function_call is not taken: send tool_choice"),
    "web_search_options": refused("web search is not run here: no hosted tools", accepts=_never),
    "moderation": refused(_NO_MODERATION),
    "store": honoured("kept in the state database (--state-dir): GET /v1/chat/completions[/{id}[/messages]], "
                      "POST (metadata) and DELETE /v1/chat/completions/{id}"),
    "verbosity": refused("only the model's own verbosity ('medium', the default) is produced here",
                         accepts=lambda v: v == "medium"),
    "metadata": honoured("kept with a stored chat completion, and what its list filters on; checked (16 keys "
                         "of up to 64 characters, values of up to 512)"),
    "prediction": honoured("a speculative draft the engine verifies: faster where it is right, never different "
                           "(greedy or seeded, the same tokens without it); the usage counts its accepted and "
                           "rejected tokens"),
    "prompt_cache_key": honoured(_AFFINITY),
    "prompt_cache_options": hint(_CACHE),
    "prompt_cache_retention": hint(_CACHE),
    "safety_identifier": hint(f"an end-user id for abuse detection: {_NO_MODERATION}"),
    "service_tier": hint(f"{_ONE_TIER}; the response says 'default', the tier it was served on"),
}

COMPLETIONS: Table = {
    **_SAMPLING, **_SDK_OPTIONS,
    "prompt": honoured(),
    "echo": honoured(),
    "logprobs": honoured(),
    "best_of": refused("choosing the best of several completions is not done here: ask for n of them and choose",
                       accepts=lambda v: v == 1),
    "suffix": refused("inserting text before a suffix is not supported"),
}

RESPONSES: Table = {
    **_SDK_OPTIONS,
    "model": honoured(),
    "input": honoured("text, function call and reasoning items"),
    "instructions": honoured(),
    "max_output_tokens": honoured(),
    "temperature": honoured(),
    "top_p": honoured(),
    "reasoning": honoured(),
    "text": honoured(),
    "tools": honoured("function and namespace tools; each other type as RESPONSES_TOOLS says"),
    "tool_choice": honoured(),
    "parallel_tool_calls": honoured(),
    "store": honoured(),
    "previous_response_id": honoured(),
    "background": honoured(),
    "stream": honoured(),
    "stream_options": honoured("include_obfuscation is taken and adds no padding"),
    "metadata": honoured("kept with the response and echoed"),
    "truncation": honoured(),
    "user": honoured("echoed, and the end user named in the request's log line"),
    "include": honoured("each value as RESPONSES_INCLUDE says: reasoning.encrypted_content is returned, any "
                        "other value is a 400 naming it"),
    "conversation": refused("conversations are not kept here: chain responses with previous_response_id"),
    "prompt": refused("stored prompt templates are not kept here: send instructions and input"),
    "context_management": refused("server-side compaction is not run here"),
    "max_tool_calls": refused("a cap on tool calls is not enforced here: parallel_tool_calls: false asks for "
                              "one call at a time"),
    "top_logprobs": refused("logprobs are not returned by the Responses API here"),
    "moderation": refused(_NO_MODERATION),
    "service_tier": hint(f"{_ONE_TIER}; the response says 'default', the tier it was served on"),
    "safety_identifier": hint(f"an end-user id for abuse detection: {_NO_MODERATION}; echoed"),
    "prompt_cache_key": honoured(f"{_AFFINITY}; echoed"),
    "prompt_cache_options": hint(_CACHE),
    "prompt_cache_retention": hint(_CACHE),
    "background_options": hint("background work runs as soon as it can (the 'soonest' window); a "
                               "continuation id changes nothing"),
    "access_programs": hint("no access programs here: every request is served alike"),
    "image": hint("image options: this server takes no images (an image input is refused)"),
}

# The Responses API's `include` values (the SDK's ResponseIncludable): None where it is returned, else why not
# (a 400 naming the value: each would add to the output what this server does not produce).
_NOT_RUN = "no {} calls are made here (hosted tools are not offered to the model: see RESPONSES_TOOLS)"
RESPONSES_INCLUDE: dict[str, str | None] = {
    "reasoning.encrypted_content": None,  # each reasoning item sealed with the server's key (sluice/sealing.py)
    "message.output_text.logprobs": "logprobs are not returned by the Responses API here (the chat completions "
                                    "API returns them)",
    "file_search_call.results": _NOT_RUN.format("file_search"),
    "web_search_call.results": _NOT_RUN.format("web_search"),
    "web_search_call.action.sources": _NOT_RUN.format("web_search"),
    "code_interpreter_call.outputs": _NOT_RUN.format("code_interpreter"),
    "computer_call_output.output.image_url": "no computer calls are made here, and this server takes no images",
    "message.input_image.image_url": "this server takes no images",
}

# The Responses API's tool types (the SDK's Tool union): None where the model is offered it, else why not. A
# tool not offered is left out of the prompt, named in the response's `warnings` (code tool_not_offered) and
# in a log line; with --strict-tools the request is a 400 naming it instead (ipc/responses.py: left_out).
_HOSTED = "a hosted tool, which OpenAI's servers run: this server runs none"
_OWN_ITEMS = ("its calls are items of a type of their own, which this server does not produce: offer it as a "
              "function tool")
RESPONSES_TOOLS: dict[str, str | None] = {
    "function": None,
    "namespace": None,  # its functions, each as namespace and name joined (ipc/responses.py: flat_name); a call
    # comes back with the function's name and its namespace
    **dict.fromkeys(["web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                     "file_search", "code_interpreter", "image_generation", "computer", "computer_use_preview",
                     "tool_search", "programmatic_tool_calling"], _HOSTED),
    "mcp": "MCP servers are not called here: offer their tools as function (or namespace) tools",
    **dict.fromkeys(["local_shell", "shell", "apply_patch", "custom"], _OWN_ITEMS),
}


_PROMPT: Table = {
    **_SDK_OPTIONS, **_ANTHROPIC_HEADERS,
    "model": honoured(),
    "messages": honoured(),
    "system": honoured(),
    "tools": honoured("custom tools"),
    "tool_choice": honoured(),
    "thinking": honoured(),
    "output_config": honoured(),
    "cache_control": hint(_CACHE),
    "speed": hint("one speed here"),
    "billing_policy": hint("nobody is billed here"),
    "context_management": honoured("clear_thinking_20251015 and clear_tool_uses_20250919 drop the named blocks of "
                                   "earlier turns before render (sluice/render/context_edits.py), and the response's "
                                   "context_management.applied_edits says what each cleared (its token counts by the "
                                   "model's tokenizer, of the cleared text; count_tokens: the count after them, and "
                                   "context_management.original_input_tokens before); compact_20260112 and any other "
                                   "edit type is a 400 naming it"),
    "compaction": refused("compaction is not run here: send the conversation"),
    "mcp_servers": refused("MCP servers are not called here: send their tools as custom tools"),
}

COUNT_TOKENS: Table = {
    **_PROMPT,
    "output_format": client("the SDK sends it as output_config.format (honoured)"),
}

MESSAGES: Table = {
    **_PROMPT,
    "max_tokens": honoured(),
    "stop_sequences": honoured(),
    "stream": honoured(),
    "metadata": honoured("user_id: the end user named in the request's log line"),
    "service_tier": honoured(f"{_ONE_TIER}; usage.service_tier says 'standard'"),
    "container": refused("code execution containers are not run here"),
    "thread": refused("conversation threads are not kept here: send the whole conversation"),
    "diagnostics": honoured("previous_message_id: the response's diagnostics.cache_miss_reason says why the prompt "
                            "could not reuse that request's prefix, as the SDK's CacheMissReason types say it "
                            "(model, system, tools or an earlier message changed, with the tokens it would have "
                            "read; the previous message not kept; or unavailable), null where it could; each "
                            "request that sends diagnostics is kept to compare the next with "
                            "(sluice/render/diagnostics.py)"),
    "inference_geo": hint("one location here: the server's"),
    "fallbacks": hint("one model here: a request runs on it alone, as on a model without fallbacks"),
    "fallback_credit_token": hint("one model here: there are no fallbacks to credit"),
}

MESSAGE_BATCHES: Table = {
    **_SDK_OPTIONS, **_ANTHROPIC_HEADERS,
    "requests": honoured("each request's params decided as in MESSAGES"),
}


def refused_fields(table: Table) -> list[tuple[str, Decision]]:
    return [(name, d) for name, d in table.items() if d.kind == "refused"]


def refuse(request: Any, refusals: list[tuple[str, Decision]]) -> None:
    """Raises the 400 of the first refused field that `request` sets. The message ends as msgspec's own do,
    with the field's path, so the error names it as its param."""
    for name, d in refusals:
        value = getattr(request, name)
        if value is not None and not d.accepts(value):
            raise ValueError(f"{name}: {d.note} - at `$.{name}`")
