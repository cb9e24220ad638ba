"""The same tokens give the same message in every dialect: Anthropic's content blocks and the Responses
API's output items are the same items (sluice.postproc.assembly), and an OpenAI chat message holds the same
reasoning and calls, its content the same text with the whitespace between items kept."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sluice.postproc.worker import Shard
from tests.postproc import test_anthropic_frames as anthropic
from tests.postproc import test_responses_frames as responses
from tests.postproc.test_shard import feed, start

_TEXT = st.text(alphabet="ab cé\n.,!", max_size=12)
_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "f"]),
                            st.dictionaries(st.sampled_from("xyz"), _TEXT, max_size=2)), max_size=2)


@pytest.fixture(scope="module")
def shard(tiny_chat_dir):
    return Shard(Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json")))


def _anthropic(shard, text: str) -> list[tuple]:
    (body,) = anthropic.run(shard, text, stream=False)
    kinds = {"thinking": "reasoning", "text": "text", "tool_use": "tool_call"}
    return [(kinds[b["type"]], b.get("thinking", b.get("text", b.get("input")))) for b in json.loads(body)["content"]]


def _responses(shard, text: str) -> list[tuple]:
    kinds = {"reasoning": "reasoning", "message": "text", "function_call": "tool_call"}
    return [(kinds[i["type"]], json.loads(i["arguments"]) if i["type"] == "function_call" else i["content"][0]["text"])
            for i in responses._run(shard, text, stream=False, final="stop")["output"]]


def _openai(shard, text: str) -> dict:
    eos = shard.tokenizer.token_to_id("<|im_end|>")
    data, _ = feed(shard, text, rid="c1", started=start(shard, "c1", parsers=["think", "hermes"]), eos=eos)
    return json.loads(data[-1])["choices"][0]["message"]


@settings(max_examples=40, deadline=None)
@given(reasoning=_TEXT, content=_TEXT, calls=_CALLS)
def test_every_dialect_holds_the_same_items(shard, reasoning, content, calls):
    text = responses._output((f"<think>{reasoning}</think>" if reasoning else "") + content, calls)
    items = _responses(shard, text)
    assert _anthropic(shard, text) == items
    message = _openai(shard, text)
    assert (message.get("reasoning_content") or "").strip() == "".join(t for k, t in items if k == "reasoning").strip()
    assert [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls") or []] == \
        [t for k, t in items if k == "tool_call"]
    assert (message["content"] or "").strip() == "".join(t for k, t in items if k == "text").strip()
