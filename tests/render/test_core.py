from __future__ import annotations

import copy
import json

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import PostprocSpec, RenderJob, bytes_to_ids
from sluice.render.errors import RequestError
from sluice.render.worker import build_core

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "refusal": None},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=64, postproc_workers=3)
    return build_core(cfg)


def job(endpoint: str, **body) -> RenderJob:
    return RenderJob("req-1", endpoint, json.dumps({"model": "m", **body}).encode(), "ipc://reply", 1000.0)


def test_prompt_equals_transformers_chat_template(core, tiny_chat_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_dir)
    # transformers takes content parts as-is; the core joins text parts first
    msgs = copy.deepcopy(CONVERSATION)
    msgs[1]["content"] = "Weather in Paris?"
    for m in msgs:
        for call in m.get("tool_calls", []):
            call["function"] = dict(call["function"], arguments=json.loads(call["function"]["arguments"]))
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in text and '"city": "Paris"' in text and text.endswith("<|im_start|>assistant\n")
    expected = tok.encode(text, add_special_tokens=False)
    core.max_model_len = 4096
    try:
        req = core.render(job("chat", messages=CONVERSATION, tools=TOOLS))
    finally:
        core.max_model_len = 64
    assert bytes_to_ids(req.prompt_token_ids).tolist() == list(expected)


@pytest.mark.parametrize("final", ["Once upon a", "  Once upon a time,  ", "Sunny.\n"])
def test_continue_final_message_leaves_it_open_as_transformers_does(core, tiny_chat_dir, final):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_dir)
    msgs = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": final}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert not text.endswith("<|im_end|>\n")
    req = core.render(job("chat", messages=msgs, add_generation_prompt=False, continue_final_message=True))
    assert bytes_to_ids(req.prompt_token_ids).tolist() == tok.encode(text, add_special_tokens=False)


def test_continue_final_message_refusals(core):
    msgs = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once"}]
    for body, param in [({"continue_final_message": True}, "continue_final_message"),  # + a generation prompt
                        ({"continue_final_message": True, "add_generation_prompt": False,
                          "messages": msgs[:1] + [{"role": "assistant", "content": " "}]}, "messages")]:
        with pytest.raises(RequestError) as e:
            core.render(job("chat", **{"messages": msgs, **body}))
        assert e.value.status == 400 and e.value.param == param, e.value


def test_sampling_spec_and_shard(core):
    req = core.render(job("chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
                          stop=["\n"], stop_token_ids=[3], stream=True, stream_options={"include_usage": True}))
    sp = req.sampling
    assert sp.max_tokens == 5 and sp.temperature == 0.0
    assert sp.stop_token_ids[0] == 3 and set(core.bundle.eos_token_ids) <= set(sp.stop_token_ids)
    spec = msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec)
    assert spec.stream and spec.include_usage and spec.stop == ["\n"] and spec.reply_to == "ipc://reply"
    assert 0 <= req.shard < 3
    ignore = core.render(job("chat", messages=[{"role": "user", "content": "hi"}], ignore_eos=True))
    assert not set(core.bundle.eos_token_ids) & set(ignore.sampling.stop_token_ids)
    prompt_len = len(bytes_to_ids(ignore.prompt_token_ids))
    assert ignore.sampling.max_tokens == 64 - prompt_len  # default: the rest of the context


@pytest.mark.parametrize("prompt", ["hello", [5, 6, 7], ["hello"], [[5, 6, 7]]])
def test_completion_prompt_shapes(core, prompt):
    req = core.render(job("completions", prompt=prompt))
    assert len(bytes_to_ids(req.prompt_token_ids)) >= 1 and req.sampling.max_tokens == 16


@pytest.mark.parametrize("body, param, code", [
    (dict(prompt="word " * 100), "messages", "context_length_exceeded"),
    (dict(prompt="hi", max_tokens=100), "max_tokens", "context_length_exceeded"),
    (dict(prompt=[1, 10**9]), "prompt", None),
    (dict(prompt=["a", "b"]), "prompt", None),
    (dict(prompt=[{"x": 1}]), "prompt", None),
])
def test_completion_rejections(core, body, param, code):
    with pytest.raises(RequestError) as e:
        core.render(job("completions", **body))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_unsupported_content_is_named(core):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError) as e:
        core.render(job("chat", messages=msgs))
    assert e.value.code == "unsupported_feature" and "multimodal_input" in e.value.message


def test_an_assistant_call_without_arguments_renders_as_one_with_none(core):
    """(FunctionCall's arguments default to "{}", which its encoding leaves out: the template still gets {}.)"""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    core.max_model_len = 4096
    try:
        with_args = core.render(job("chat", messages=[*messages[:1], {**messages[1], "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": "{}"}}]}, messages[2]], tools=TOOLS))
        assert core.render(job("chat", messages=messages, tools=TOOLS)).prompt_token_ids == with_args.prompt_token_ids
    finally:
        core.max_model_len = 64
