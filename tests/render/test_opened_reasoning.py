"""A chat template that opens the reasoning block itself (DeepSeek-R1's, Qwen3 thinking models': the prompt ends
`<think>\\n`): with the think parser, what the model writes before `</think>` is reasoning, though it never
wrote `<think>`."""
from __future__ import annotations

import json

import msgspec
from tokenizers import Tokenizer

from sluice.base.config import ServerConfig
from sluice.ipc.messages import PostprocSpec, RenderJob, Started, bytes_to_ids
from sluice.postproc.worker import Shard
from sluice.render.tokenizer import chat_template
from sluice.render.worker import build_core
from tests.postproc.test_shard import feed


def _rendered(tiny_chat_dir, tmp_path, opens: bool, **options):
    template = chat_template(tiny_chat_dir) + ("<think>\n" if opens else "")
    (tmp_path / "t.jinja").write_text(template)
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=256, chat_template=str(tmp_path / "t.jinja"), **options)
    job = RenderJob("r1", "chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
                    "ipc://r", 1.0)
    return build_core(cfg).render(job)


def _message(tiny_chat_dir, request, output: str) -> dict:
    shard = Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))
    spec = msgspec.structs.replace(msgspec.msgpack.decode(request.postproc_spec, type=PostprocSpec), reply_to="ipc://r")
    data, _ = feed(shard, output, started=Started("r1", msgspec.msgpack.encode(spec), 5, 0))
    return json.loads(data[-1])["choices"][0]["message"]


def test_what_comes_before_the_close_is_reasoning_when_the_prompt_opened_it(tiny_chat_dir, tmp_path):
    request = _rendered(tiny_chat_dir, tmp_path, True, reasoning_parser="think")
    tokenizer = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    prompt = tokenizer.decode(bytes_to_ids(request.prompt_token_ids).tolist(), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>")  # (the prompt the model sees is the template's)
    message = _message(tiny_chat_dir, request, "I ponder.</think>The answer.")
    assert (message["reasoning_content"], message["content"]) == ("I ponder.", "The answer.")


def test_a_prompt_that_does_not_open_it_and_a_server_without_the_parser_are_as_before(tiny_chat_dir, tmp_path):
    closed = _message(tiny_chat_dir, _rendered(tiny_chat_dir, tmp_path, False, reasoning_parser="think"),
                      "<think>I ponder.</think>The answer.")
    assert (closed["reasoning_content"], closed["content"]) == ("I ponder.", "The answer.")
    plain = _message(tiny_chat_dir, _rendered(tiny_chat_dir, tmp_path, True), "I ponder.</think>The answer.")
    assert plain["content"] == "I ponder.</think>The answer." and not plain.get("reasoning_content")


def test_qwen3_and_deepseek_r1_read_what_comes_before_the_close_as_reasoning(tiny_chat_dir, tmp_path):
    for parser in ("qwen3", "deepseek_r1"):
        opened = _message(tiny_chat_dir, _rendered(tiny_chat_dir, tmp_path, True, reasoning_parser=parser),
                          "I ponder.</think>The answer.")
        assert (opened["reasoning_content"], opened["content"]) == ("I ponder.", "The answer."), parser
    # deepseek_r1: the model's own <think> too; qwen3 (enable_thinking false, no tags): all of it is the answer
    own = _message(tiny_chat_dir, _rendered(tiny_chat_dir, tmp_path, False, reasoning_parser="deepseek_r1"),
                   "<think>I ponder.</think>The answer.")
    assert (own["reasoning_content"], own["content"]) == ("I ponder.", "The answer.")
    plain = _message(tiny_chat_dir, _rendered(tiny_chat_dir, tmp_path, False, reasoning_parser="qwen3"), "The answer.")
    assert plain["content"] == "The answer." and not plain.get("reasoning_content")


def test_a_forced_call_under_deepseek_r1_closes_the_reasoning_first(tiny_chat_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=1024, reasoning_parser="deepseek_r1", tool_parser="hermes")
    request = build_core(cfg).render(RenderJob("r1", "chat", json.dumps(body).encode(), "ipc://r", 1.0))
    message = _message(tiny_chat_dir, request, '{"a": 1}}\n</tool_call>')
    assert not message.get("reasoning_content") and not message["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("f", {"a": 1})]
