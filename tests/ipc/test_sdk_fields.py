"""Every parameter of the installed official SDKs' create calls has a decision in ipc/sdk_fields.py, and the
route's request Struct does what it says: null is unset for every field, a refused value is a 400 naming the
field, a hint is taken. A new SDK release (moved on deliberately in pyproject's test extras) that adds a
parameter fails here, naming it."""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable

import anthropic
import msgspec
import openai
import pytest
from anthropic.resources.beta.messages import Messages as BetaMessages
from anthropic.resources.beta.messages.batches import Batches as BetaBatches
from anthropic.resources.messages import Messages
from anthropic.resources.messages.batches import Batches
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions
from openai.resources.responses import Responses
from openai.types.responses.namespace_tool import Tool as NamespaceMember
from openai.types.responses.response_includable import ResponseIncludable
from openai.types.responses.tool import Tool as ResponsesToolUnion

from sluice.ingress.http import validation_error
from sluice.schemas import sdk_fields
from sluice.schemas.anthropic import BatchCreateRequest, CountTokensRequest, MessagesRequest
from sluice.schemas.openai import ChatCompletionRequest, CompletionRequest
from sluice.schemas.responses import CreateResponse

USER = [{"role": "user", "content": "x"}]


@dataclass(frozen=True)
class Route:
    table: sdk_fields.Table
    struct: type
    minimal: dict[str, Any]  # the fewest fields of a body the Struct takes
    methods: tuple[Callable, ...]  # the SDK calls that post to it


ROUTES = {
    "chat": Route(sdk_fields.CHAT_COMPLETIONS, ChatCompletionRequest, {"model": "m", "messages": USER},
                  (ChatCompletions.create,)),
    "completions": Route(sdk_fields.COMPLETIONS, CompletionRequest, {"model": "m", "prompt": "x"},
                         (Completions.create,)),
    "responses": Route(sdk_fields.RESPONSES, CreateResponse, {"model": "m", "input": "x"}, (Responses.create,)),
    "messages": Route(sdk_fields.MESSAGES, MessagesRequest, {"model": "m", "max_tokens": 4, "messages": USER},
                      (Messages.create, BetaMessages.create)),
    "count_tokens": Route(sdk_fields.COUNT_TOKENS, CountTokensRequest, {"model": "m", "messages": USER},
                          (Messages.count_tokens, BetaMessages.count_tokens)),
    "batches": Route(sdk_fields.MESSAGE_BATCHES, BatchCreateRequest,
                     {"requests": [{"custom_id": "a", "params": {"model": "m", "max_tokens": 4, "messages": USER}}]},
                     (Batches.create, BetaBatches.create)),
}

# A value of each refused field that asks for what this server cannot do (a typical one from the API's docs).
REFUSED_SAMPLES: dict[str, dict[str, Any]] = {
    "chat": {"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
             "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
             "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"}, "verbosity": "low"},
    "completions": {"best_of": 3, "suffix": "}"},
    "responses": {"conversation": "conv_1",
                  "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}],
                  "max_tool_calls": 2, "top_logprobs": 3, "moderation": {"model": "omni-moderation-latest"}},
    "count_tokens": {"compaction": {"type": "summarize"},
                     "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
    "messages": {"container": "container_1", "thread": {"type": "create"}},
}
REFUSED_SAMPLES["messages"] = {**REFUSED_SAMPLES["count_tokens"], **REFUSED_SAMPLES["messages"]}

# Values of refused fields that ask for what this server does anyway, and hints as frameworks send them.
TAKEN: dict[str, dict[str, Any]] = {
    "chat": {"store": False, "modalities": ["text"], "verbosity": "medium", "metadata": {"app": "x"},
             "service_tier": "auto", "prompt_cache_key": "x", "prompt_cache_retention": "24h",
             "prompt_cache_options": {"mode": "implicit"}, "safety_identifier": "u",
             "prediction": {"type": "content", "content": "draft"}, "functions": [],
             "stream_options": {"include_usage": True, "include_obfuscation": False}},
    "completions": {"best_of": 1, "suffix": ""},
    "responses": {"include": ["reasoning.encrypted_content"], "metadata": {"app": "x"}, "service_tier": "flex",
                  "prompt_cache_key": "x", "safety_identifier": "u",
                  "background_options": {"completion_window": "soonest"}, "access_programs": {"cyber": "standard"},
                  "image": {"context_compression": "auto"},
                  "top_logprobs": 0, "stream_options": {"include_obfuscation": False}},
    "messages": {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                 "mcp_servers": [], "speed": "fast", "inference_geo": "us",
                 "diagnostics": {"previous_message_id": None},
                 "fallbacks": "default", "billing_policy": {"type": "billing_policy"}, "service_tier": "auto",
                 "metadata": {"user_id": "u"}, "cache_control": {"type": "ephemeral"}},
}


def _parameters(method: Callable) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p != "self"]


def _decode(route: Route, **fields: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode({**route.minimal, **fields}), type=route.struct)


def _body_fields(route: Route) -> list[str]:
    return [name for name, d in route.table.items() if d.kind != "client"]


@pytest.mark.parametrize("name", ROUTES)
def test_every_parameter_of_the_installed_sdks_create_calls_has_a_decision(name):
    route = ROUTES[name]
    missing = [f"{m.__qualname__}({p})" for m in route.methods for p in _parameters(m) if p not in route.table]
    assert not missing, (f"openai {openai.__version__} / anthropic {anthropic.__version__}: these parameters are in "
                         f"no table of ipc/sdk_fields.py ({name}); decide each: {missing}")


@pytest.mark.parametrize("name", ROUTES)
def test_every_decision_is_of_a_parameter_the_sdks_have(name):
    route = ROUTES[name]
    known = {p for m in route.methods for p in _parameters(m)}
    assert not set(route.table) - known, f"stale entries in ipc/sdk_fields.py ({name}): {set(route.table) - known}"


@pytest.mark.parametrize("name", ROUTES)
def test_null_is_unset_for_every_body_field(name):
    route = ROUTES[name]
    for field in _body_fields(route):
        assert field in route.struct.__struct_encode_fields__, f"{route.struct.__name__} does not declare {field}"
        if field not in route.minimal:
            _decode(route, **{field: None})
    _decode(route, **{f: None for f in _body_fields(route) if f not in route.minimal})


@pytest.mark.parametrize("name, field", [(name, f) for name, r in ROUTES.items()
                                         for f, _ in sdk_fields.refused_fields(r.table)])
def test_a_refused_value_is_a_400_that_names_the_field_and_says_why(name, field):
    sample = REFUSED_SAMPLES.get(name, {})
    assert field in sample, f"add a value of {field} that this server cannot honour to REFUSED_SAMPLES[{name!r}]"
    with pytest.raises(msgspec.ValidationError) as e:
        _decode(ROUTES[name], **{field: sample[field]})
    message, param = validation_error(e.value)
    assert param == field and message.startswith(f"{field}: {ROUTES[name].table[field].note}")


@pytest.mark.parametrize("name", TAKEN)
def test_hints_and_values_that_ask_for_what_this_server_does_are_taken(name):
    request = _decode(ROUTES[name], **TAKEN[name])
    for field, value in TAKEN[name].items():
        got = getattr(request, field)
        assert (msgspec.to_builtins(got) if isinstance(got, msgspec.Struct) else got) == value


def test_a_refused_field_inside_a_batch_request_names_its_index():
    from sluice.ingress.anthropic import _checked, _Refused

    body = msgspec.json.decode(msgspec.json.encode({"requests": [
        {"custom_id": "a", "params": {"model": "m", "max_tokens": 4, "messages": USER}},
        {"custom_id": "b", "params": {"model": "m", "max_tokens": 4, "messages": USER, "container": "c"}}]}),
        type=BatchCreateRequest)
    with pytest.raises(_Refused) as e:
        _checked(body)
    assert e.value.failure.param == "requests[1].params.container" and "containers" in e.value.failure.message


def test_every_include_value_and_tool_type_of_the_installed_sdk_has_a_decision():
    """The Responses API's per-value decisions: a new includable or tool type fails here, naming it."""
    includable = set(typing.get_args(ResponseIncludable))
    assert includable == set(sdk_fields.RESPONSES_INCLUDE), (
        f"openai {openai.__version__}: decide each in ipc/sdk_fields.py RESPONSES_INCLUDE: "
        f"{includable ^ set(sdk_fields.RESPONSES_INCLUDE)}")
    kinds = {k for cls in typing.get_args(typing.get_args(ResponsesToolUnion)[0])
             for k in typing.get_args(cls.model_fields["type"].annotation)}
    kinds |= {k for cls in typing.get_args(typing.get_args(NamespaceMember)[0])
              for k in typing.get_args(cls.model_fields["type"].annotation)}
    assert kinds == set(sdk_fields.RESPONSES_TOOLS), (
        f"openai {openai.__version__}: decide each in ipc/sdk_fields.py RESPONSES_TOOLS: "
        f"{kinds ^ set(sdk_fields.RESPONSES_TOOLS)}")


@pytest.mark.parametrize("value", list(sdk_fields.RESPONSES_INCLUDE))
def test_each_include_value_is_returned_or_a_400_that_names_it_and_says_why(value):
    why = sdk_fields.RESPONSES_INCLUDE[value]
    if why is None:
        assert _decode(ROUTES["responses"], include=[value]).include == [value]
        return
    with pytest.raises(msgspec.ValidationError) as e:
        _decode(ROUTES["responses"], include=["reasoning.encrypted_content", value])
    message, param = validation_error(e.value)
    assert param == "include" and f"{value!r}" in message and why in message
