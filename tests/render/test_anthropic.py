"""The Anthropic dialect's translation into the chat core's request, rendered by the real core."""
from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.base.config import ServerConfig
from sluice.ipc.messages import PostprocSpec, RenderJob, bytes_to_ids
from sluice.render.anthropic import ERROR_PREFIX
from sluice.render.errors import RequestError
from sluice.render.worker import build_core
from sluice.schemas.anthropic import Framing
from tests.render.test_core import CONVERSATION, TOOLS

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
# test_core's CONVERSATION, as Anthropic's clients send it
ANTHROPIC_CONVERSATION = dict(system="You are terse.", messages=[
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Sunny.", "citations": None}]},
    {"role": "user", "content": "Thanks"},
])


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=4096, tool_parser="hermes", reasoning_parser="think")
    return build_core(cfg)


def job(endpoint: str, count_only: bool = False, **body) -> RenderJob:
    body = {"model": "m", **({"max_tokens": 16} if endpoint == "messages" else {}), **body}
    return RenderJob("msg_1", endpoint, json.dumps(body).encode(), "ipc://reply", 1000.0,
                     answer="count" if count_only else "engine")


def prompt(core, **body) -> list[int]:
    return bytes_to_ids(core.render(job("messages", **body)).prompt_token_ids).tolist()


def text_of(core, ids: list[int]) -> str:
    return core.bundle.tokenizer.decode(ids, skip_special_tokens=False)


def test_a_conversation_renders_as_its_openai_twin(core):
    openai = bytes_to_ids(core.render(job("chat", messages=CONVERSATION, tools=TOOLS)).prompt_token_ids).tolist()
    assert prompt(core, tools=ANTHROPIC_TOOLS, **ANTHROPIC_CONVERSATION) == openai


def test_count_is_the_prompt_a_request_renders(core):
    body = dict(tools=ANTHROPIC_TOOLS, **ANTHROPIC_CONVERSATION)
    assert core.count(job("messages", count_only=True, **body)) == len(prompt(core, **body))


def test_sampling_stop_user_and_framing_reach_the_engine_and_postproc(core):
    req = core.render(job("messages", messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.5,
                          top_p=0.9, top_k=5, stop_sequences=["END"], stream=True, metadata={"user_id": "u1"},
                          tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                          thinking={"type": "adaptive", "display": "omitted"}))
    sp = req.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (7, 0.5, 0.9, 5)
    spec = msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec)
    assert (spec.endpoint, spec.stream, spec.stop, spec.user, spec.parallel_tool_calls) == (
        "messages", True, ["END"], "u1", False)
    assert spec.parsers == ["think", "hermes"] and not spec.logprobs and spec.n == 1
    assert msgspec.msgpack.decode(spec.dialect, type=Framing) == Framing(omit_thinking=True)


def test_system_text_from_anywhere_is_one_leading_system_message(core):
    text = text_of(core, prompt(core, system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                                              {"type": "text", "text": "Be brief.",
                                               "cache_control": {"type": "ephemeral"}}],
                                messages=[{"role": "system", "content": " Use metric."},
                                          {"role": "user", "content": "Hi"}]))
    assert text.startswith("<|im_start|>system\nBe brief. Use metric.<|im_end|>\n<|im_start|>user\nHi")
    assert "billing" not in text


def test_thinking_tool_results_and_errors_are_in_the_prompt(core):
    text = text_of(core, prompt(core, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "c2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "c2", "content": "no such city", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]))
    assert "<think>\nNeed the tool.\n</think>\n\nChecking.<tool_call>" in text and "opaque" not in text
    assert '"Rome"' in text and "<|im_start|>tool\nsunny<|im_end|>" in text
    assert f"<|im_start|>tool\n{ERROR_PREFIX}no such city<|im_end|>\n<|im_start|>user\nAnd tomorrow?" in text


@pytest.mark.parametrize("how", ["any", "named", "strict"])
def test_any_tool_choice_a_named_tool_and_strict_tools_hold_the_calls_to_their_schemas(core, how):
    held = {"any": {"tool_choice": {"type": "any"}}, "strict": {"tools": [dict(ANTHROPIC_TOOLS[0], strict=True)]},
            "named": {"tool_choice": {"type": "tool", "name": ANTHROPIC_TOOLS[0]["name"]}}}[how]
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": ANTHROPIC_TOOLS, **held}
    request = core.render(job("messages", **body))
    assert request.grammar and request.grammar_trigger == []


def test_an_enabled_thinking_budget_is_the_cores_thinking_token_budget(core):
    """Anthropic's thinking.budget_tokens is held as OpenAI's thinking_token_budget is: by a grammar that ends the
    reasoning after that many tokens (tests/engine/test_thinking_budget.py runs it)."""
    ask = [{"role": "user", "content": "Hi"}]
    anthropic = core.render(job("messages", messages=ask, thinking={"type": "enabled", "budget_tokens": 2048}))
    openai = core.render(job("chat", messages=ask, thinking_token_budget=2048))
    assert anthropic.grammar == openai.grammar and "think[max_tokens=2048]" in anthropic.grammar
    assert anthropic.grammar_param == "thinking_token_budget" and anthropic.grammar_trigger == []
    assert core.render(job("messages", messages=ask, thinking={"type": "adaptive"})).grammar == ""


@pytest.mark.parametrize("body, param, code, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
     "unsupported_feature", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": [
        {"type": "document", "source": {}}]}]}]}, "messages[0].content[0].content[0]", "unsupported_feature",
     "document"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]}, "messages[1]", None,
     "prefill"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages", None, "user message"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "c"}]},
                   {"role": "user", "content": "Hi"}]}, "messages[0].content[0]", None, "tool_result"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "tools[0]",
     "unsupported_feature", "web_search_20250305"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", None, "required"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name", None, "nope"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "tools": ANTHROPIC_TOOLS,
      "tool_choice": {"type": "any"}}, "thinking_token_budget", None, "cannot be combined with tools"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", None, "budget_tokens"),
])
def test_what_the_core_cannot_do_is_a_400_that_names_it(core, body, param, code, words):
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(RequestError) as e:
        core.render(job("messages", **body))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert words in e.value.message


_text = st.text(st.sampled_from("abc xyz"), min_size=1, max_size=8).filter(str.strip)
_block = st.one_of(
    st.builds(lambda t: ("user", {"type": "text", "text": t}, [t]), _text),
    st.builds(lambda t, err: ("user", {"type": "tool_result", "tool_use_id": "c", "content": t, "is_error": err},
                              [ERROR_PREFIX + t if err else t]), _text, st.booleans()),
    st.builds(lambda t: ("assistant", {"type": "text", "text": t}, [t]), _text),
    st.builds(lambda t: ("assistant", {"type": "thinking", "thinking": t, "signature": ""}, [t]), _text),
    st.builds(lambda t: ("assistant", {"type": "tool_use", "id": "c", "name": "f", "input": {"q": t}}, [t]), _text),
)


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(st.lists(_block, min_size=1, max_size=3), min_size=1, max_size=5))
def test_every_text_of_a_conversation_is_rendered_in_its_order(core, turns):
    """Turns alternate user / assistant and end with a user turn; the prompt holds what each turn says, in
    the order the core renders a turn (an assistant's thinking, text, then its calls; a user's tool results
    and text as they come)."""
    messages, expected = [], []
    for k, turn in enumerate(turns):
        role = "user" if (len(turns) - k) % 2 else "assistant"
        blocks = [(block, texts) for r, block, texts in turn if r == role] or [
            ({"type": "text", "text": "ok"}, ["ok"])]
        messages.append({"role": role, "content": [block for block, _ in blocks]})
        order = {"thinking": 0, "text": 1, "tool_use": 2} if role == "assistant" else {}
        for block, texts in sorted(blocks, key=lambda b: order.get(b[0]["type"], 0)):
            expected += texts
    rendered, at = text_of(core, prompt(core, messages=messages)), 0
    for text in expected:
        at = rendered.index(text, at) + len(text)


def test_output_config_asks_the_core_for_effort_and_a_json_schema(core):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = core.render(job("messages", messages=[{"role": "user", "content": "Hi"}],
                          output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}}))
    assert req.grammar and req.grammar_trigger == []
