"""gpt-oss through the shared chat core: harmony rendering and what it rejects."""
from __future__ import annotations

import json
from datetime import date

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from sluice.app.builtin_models import ensure_builtin
from sluice.base.config import ServerConfig
from sluice.base.harmony_vocab import harmony_encoding
from sluice.ipc.messages import RenderJob, bytes_to_ids
from sluice.render.errors import RequestError
from sluice.render.extensions import ExtensionOptions, HfChatTemplateExtension, check_parsers, extension_class
from sluice.render.harmony import (developer_instructions, developer_message, function_tools, harmony_prompt_ids,
                                   system_message, turn_messages)
from sluice.render.worker import build_core
from sluice.schemas.openai import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def gpt_oss_dir():
    return ensure_builtin("tiny-gpt-oss")


@pytest.fixture(scope="module")
def core(gpt_oss_dir):
    """The default options' render core (its tokenizer and grammar compiler take seconds to start: one for all)."""
    return make_core(gpt_oss_dir)


def make_core(path, **options):
    cfg = ServerConfig(model="m", model_path=str(path), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=4096, **options)
    return build_core(cfg)


def job(**body) -> RenderJob:
    return RenderJob("req-1", "chat", json.dumps({"model": "m", **body}).encode(), "ipc://reply", 0.0)


def expected_ids(effort=ReasoningEffort.HIGH) -> list[int]:
    """The same conversation, built directly with openai-harmony."""
    enc = harmony_encoding()
    system = SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(date.today().isoformat())
    dev = DeveloperContent.new().with_instructions("Be brief.").with_function_tools(
        [ToolDescription.new("get_weather", "Weather for a city", TOOLS[0]["function"]["parameters"])])
    msgs = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, dev),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I should call the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "sunny")
        .with_channel("commentary").with_recipient("assistant"),
        Message.from_role_and_content(Role.ASSISTANT, "Sunny.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "Thanks!"),
    ]
    return enc.render_conversation_for_completion(Conversation.from_messages(msgs), Role.ASSISTANT)


def test_prompt_equals_openai_harmony_rendering(core):
    req = core.render(job(messages=CONVERSATION, tools=TOOLS, reasoning_effort="high"))
    assert bytes_to_ids(req.prompt_token_ids).tolist() == expected_ids()
    assert {200002, 200012} <= set(req.sampling.stop_token_ids)  # <|return|>, <|call|>


def test_the_apis_other_efforts_are_the_nearest_of_gpt_osss_three(core):
    """none and minimal render as low, xhigh and max as high (what Codex and today's SDKs may send; the
    Responses API's reasoning.effort and Anthropic's output_config.effort become this field)."""

    def prompt(**fields) -> list[int]:
        return bytes_to_ids(core.render(job(messages=CONVERSATION[:2], **fields)).prompt_token_ids).tolist()

    for effort, level in (("none", "low"), ("minimal", "low"), ("xhigh", "high"), ("max", "high")):
        assert prompt(reasoning_effort=effort) == prompt(reasoning_effort=level) != prompt(reasoning_effort="medium")
    assert "Reasoning: high" in harmony_encoding().decode(prompt(reasoning_effort="xhigh"))


def test_named_tool_choice_forces_the_call(core):
    req = core.render(job(messages=CONVERSATION[:2], tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    text = harmony_encoding().decode(bytes_to_ids(req.prompt_token_ids).tolist())
    assert text.endswith("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                         "<|constrain|>json<|message|>")


@pytest.mark.parametrize("body, feature", [
    ({"thinking_token_budget": 100}, "thinking_token_budget"),
    ({"chat_template": "{{ messages }}"}, "request_chat_template"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
])
def test_what_gpt_oss_rejects_and_why(core, body, feature):
    with pytest.raises(RequestError) as e:
        core.render(job(messages=CONVERSATION[:2], **body))
    assert e.value.status == 400 and feature in e.value.message and e.value.code == "unsupported_feature"


def test_trusted_request_chat_template(gpt_oss_dir):
    core = make_core(gpt_oss_dir, trust_request_chat_template=True)
    req = core.render(job(messages=[{"role": "user", "content": "hi"}],
                          chat_template="<|start|>user<|message|>{{ messages[0].content }}<|end|><|start|>assistant"))
    assert harmony_encoding().decode(bytes_to_ids(req.prompt_token_ids).tolist()) == \
        "<|start|>user<|message|>hi<|end|><|start|>assistant"


def test_no_harmony_uses_the_hf_template_as_text(gpt_oss_dir):
    core = make_core(gpt_oss_dir, harmony=False)
    req = core.render(job(messages=[{"role": "user", "content": "hi"}]))
    text = harmony_encoding().decode(bytes_to_ids(req.prompt_token_ids).tolist())
    assert text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert core.ext.output_mode == "text"


@pytest.mark.parametrize("model_type, options, ok", [
    ("gpt_oss", dict(tool_parser="gpt_oss", reasoning_parser="gpt_oss"), True),
    ("gpt_oss", dict(tool_parser="hermes"), False),
    ("gpt_oss", dict(reasoning_parser="think"), False),
    ("gpt_oss", dict(tool_parser="hermes", harmony=False), True),
    ("qwen3", dict(tool_parser="hermes", reasoning_parser="think"), True),
    ("qwen3", dict(tool_parser="gpt_oss"), False),
    ("qwen3", dict(reasoning_parser="nonsense"), False),
])
def test_parser_flags_are_checked_at_startup(model_type, options, ok):
    if ok:
        check_parsers({"model_type": model_type}, ExtensionOptions(**options))
    else:
        with pytest.raises(ValueError, match="cannot apply"):
            check_parsers({"model_type": model_type}, ExtensionOptions(**options))


def test_what_is_model_specific_is_asked_of_the_extension_that_serves_the_model():
    import shutil

    from sluice.app.cli import config_from_args, parse_args

    harmony = extension_class({"model_type": "gpt_oss"}, ExtensionOptions())
    as_text = extension_class({"model_type": "gpt_oss"}, ExtensionOptions(harmony=False))
    assert (harmony.output_mode, as_text.output_mode) == ("tokens", "text")
    assert "harmony" in (harmony.post_processor_hook_refusal or "")
    assert as_text is extension_class({"model_type": "llama"}, ExtensionOptions()) is HfChatTemplateExtension
    assert as_text.post_processor_hook_refusal is None
    # (what the other stages, which do not load the extensions, read of it: the ingress's health check, the
    # postproc's preload)
    cfg = config_from_args(parse_args(["serve", "builtin:tiny-gpt-oss"]))
    shutil.rmtree(cfg.runtime_dir)
    assert cfg.output_mode == "tokens"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_gpt_oss_forced_calls_are_held_by_a_grammar_over_the_whole_output(core, choice):
    req = core.render(job(messages=CONVERSATION[:2], tools=TOOLS, tool_choice=choice))
    assert req.grammar and req.grammar_trigger == []  # (reasoning stays free inside the grammar)


# ---- the cached system and developer messages ----------------------------------------------------------

_text = st.text(st.sampled_from(list("ab \n.{}<|>é🙂")), max_size=12)
_content = _text | st.lists(st.builds(lambda t: {"type": "text", "text": t}, _text), max_size=2)
_tool = st.builds(lambda name, desc, props: {"type": "function", "function": {
    "name": name, **({"description": desc} if desc is not None else {}),
    "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in props}}}},
    st.sampled_from(["get_weather", "add"]), st.none() | _text, st.lists(st.sampled_from(["city", "n"]), max_size=2))
_call = st.builds(lambda i, name, args: {"id": f"c{i}", "type": "function",
                                         "function": {"name": name, "arguments": json.dumps(args)}},
                  st.integers(0, 2), st.sampled_from(["get_weather", "add"]),
                  st.dictionaries(st.sampled_from(["city", "n"]), st.integers(0, 99), max_size=2))
_message = st.one_of(
    st.builds(lambda role, c: {"role": role, "content": c}, st.sampled_from(["system", "developer"]), _content),
    st.builds(lambda c: {"role": "user", "content": c}, _content),
    st.builds(lambda c, key, reasoning, calls: {"role": "assistant", "content": c, key: reasoning,
                                                **({"tool_calls": calls} if calls else {})},
              st.none() | _content, st.sampled_from(["reasoning_content", "reasoning"]), st.none() | _text,
              st.lists(_call, max_size=2)),
    st.builds(lambda i, name, c: {"role": "tool", "tool_call_id": f"c{i}", "content": c,
                                  **({"name": name} if name else {})},
              st.integers(0, 3), st.none() | st.sampled_from(["add", "lookup"]), _content),
)
_response_format = st.none() | st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
    lambda desc: {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"},
                                                         **({"description": desc} if desc else {})}}, _text)


def harmony_messages(request: ChatCompletionRequest, today: str | None) -> list[Message]:
    """The whole conversation in harmony, rendered at once by the reference below."""
    system = system_message(request.reasoning_effort or "medium", today or date.today().isoformat())
    developer = developer_message(developer_instructions(request), function_tools(request))
    return [system, *([developer] if developer else []), *turn_messages(request)]


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=7), tools=st.none() | st.lists(_tool, max_size=2),
       tool_choice=st.sampled_from([None, "auto", "none", "required"]), response_format=_response_format,
       effort=st.sampled_from([None, "low", "medium", "high"]),
       today=st.sampled_from([None, "2026-12-01", "2026-12-02"]))
def test_cached_system_and_developer_tokens_equal_harmonys_full_render(messages, tools, tool_choice,
                                                                        response_format, effort, today):
    body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": tool_choice,
            "response_format": response_format, "reasoning_effort": effort}
    request = msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    convo = Conversation.from_messages(harmony_messages(request, today))
    full = harmony_encoding().render_conversation_for_completion(convo, Role.ASSISTANT)
    assert harmony_prompt_ids(request, today) == full
    assert harmony_prompt_ids(request, today) == full  # from the caches


_specials = st.sampled_from(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                             "<|constrain|>", "<|endoftext|>", "<|reserved_200012|>"])
_any_text = st.lists(st.text(max_size=20) | _specials, max_size=6).map("".join)


@settings(max_examples=200, deadline=None)
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "developer", "user", "user"]), _any_text), min_size=1,
                      max_size=5),
       today=st.sampled_from([None, "2026-12-02"]))
def test_user_turns_render_as_harmony_renders_them(turns, today):
    """User turns (any text: special tokens' text, any unicode) take their own path past harmony's render of
    the conversation; the tokens are harmony's."""
    request = msgspec.convert({"model": "m", "messages": [{"role": r, "content": c} for r, c in turns]},
                              ChatCompletionRequest)
    convo = Conversation.from_messages(harmony_messages(request, today))
    assert harmony_prompt_ids(request, today) == harmony_encoding().render_conversation_for_completion(
        convo, Role.ASSISTANT)
