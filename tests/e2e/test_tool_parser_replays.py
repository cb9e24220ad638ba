"""Each tool parser (and the qwen3 / deepseek_r1 reasoning parsers) on recorded outputs in its model family's real
format (issue 33): the text is tokenized with tiny-chat's byte-level tokenizer into a replay file, served with
`--runner replay --tool-parser NAME`, and read back through the openai SDK, non-streamed and streamed. Both must
give exactly the recorded calls, the text before them as content, and finish_reason "tool_calls".
(The parsers' chunking, one by one: tests/postproc/test_tool_parsers.py.)"""
from __future__ import annotations

import json

import openai
import pytest

from bench.server import Server

MODEL = "builtin:tiny-chat"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"},
                                                                         "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_forecast", "description": "Forecast for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris now, and the forecast for Lyon?"}]
TWO = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_forecast", {"city": "Lyon", "days": 3})]
DS = ("<｜tool▁calls▁begin｜>"
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Paris\", \"unit\": \"celsius\"}\n```"
      "<｜tool▁call▁end｜>\n"
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_forecast\n```json\n{\"city\": \"Lyon\", \"days\": 3}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

# parser: [(recorded text, content, reasoning, calls)], each as the family's chat template / docs show it.
CASES: dict[str, list[tuple[str, str | None, str | None, list]]] = {
    # Llama 3.1-3.3 JSON tool calling: the call object is the whole output; `;` between parallel calls.
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_forecast", "parameters": {"city": "Lyon", "days": 3}}', None, None, TWO),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
         None, None, TWO[:1]),
    ],
    # Mistral: before tokenizer v11 a JSON list after [TOOL_CALLS]; from v11 `name[ARGS]{...}` per call.
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_forecast", "arguments": {"city": "Lyon", "days": 3}}]', None, None, TWO),
        ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
         '[TOOL_CALLS]get_forecast[ARGS]{"city": "Lyon", "days": 3}', "Let me check.", None, TWO),
    ],
    # Qwen3-Coder: XML-ish blocks, the values typed by the request's schemas (days: integer).
    "qwen3_coder": [
        ("I'll look both up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_forecast>\n"
         "<parameter=city>\nLyon\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         "I'll look both up.\n", None, TWO),
    ],
    # DeepSeek-V3 (-0324): `function<｜tool▁sep｜>NAME` and the arguments in a json fence.
    "deepseek_v3": [
        ("Checking the weather." + DS, "Checking the weather.", None, TWO),
        # V3.1: `NAME<｜tool▁sep｜>{...}`
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"unit\": "
         "\"celsius\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, None, TWO[:1]),
    ],
    # Pythonic (Llama 3.2 / Llama 4, ToolACE): a Python list of calls; Llama 4 wraps it.
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_forecast(city="Lyon", days=3)]', None, None, TWO),
        ('<|python_start|>[get_weather(city="Paris", unit="celsius"), get_forecast(city="Lyon", days=3)]'
         '<|python_end|>', None, None, TWO),
    ],
    # Granite 3.x: <|tool_call|> then a JSON list.
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_forecast", "arguments": {"city": "Lyon", "days": 3}}]', None, None, TWO),
    ],
    # Reasoning: Qwen3 writes <think>...</think>; DeepSeek-R1's template opens <think> in the prompt, so the
    # output has only </think>; R1-0528 then calls tools in V3's format.
    "qwen3": [
        ("<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny in Paris.", "\n\nIt is sunny in Paris.",
         "\nThe user asks about Paris.\n", []),
    ],
    "deepseek_r1": [
        ("The user wants the weather.\n</think>\n\nIt is sunny in Paris.", "\n\nIt is sunny in Paris.",
         "The user wants the weather.\n", []),
        ("I need both tools.\n</think>\n\n" + DS, "\n\n", "I need both tools.\n", TWO),
    ],
}
FLAGS = {"qwen3": ("--reasoning-parser", "qwen3"),
         "deepseek_r1": ("--reasoning-parser", "deepseek_r1", "--tool-parser", "deepseek_v3")}


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))


@pytest.fixture(params=list(CASES))
def served(request, tokenizer, tmp_path):
    name = request.param
    end = tokenizer.token_to_id("<|im_end|>")
    path = tmp_path / f"{name}.jsonl"
    # Each recording twice in a row (non-streamed, then streamed); requests take them in arrival order.
    lines = [json.dumps(tokenizer.encode(text, add_special_tokens=False).ids + [end])
             for text, *_ in CASES[name] for _ in range(2)]
    path.write_text("\n".join(lines))
    flags = FLAGS.get(name, ("--tool-parser", name))
    s = Server("--runner", "replay", "--replay-file", str(path), *flags,
               "--render-workers", "1", "--postproc-workers", "1", "--ingress-workers", "1")
    yield name, s
    assert s.stop() == 0, s.output()


def _merge(chunks) -> dict:
    out = {"content": None, "reasoning": None, "calls": {}, "finish": None}
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        if d.content:
            out["content"] = (out["content"] or "") + d.content
        if reasoning := (d.model_extra or {}).get("reasoning_content"):
            out["reasoning"] = (out["reasoning"] or "") + reasoning
        for t in d.tool_calls or []:
            call = out["calls"].setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or t.id
            call["name"] += (t.function and t.function.name) or ""
            call["arguments"] += (t.function and t.function.arguments) or ""
        out["finish"] = c.choices[0].finish_reason or out["finish"]
    return out


def test_recorded_outputs_parse_the_same_streamed_and_not(served):
    name, server = served
    client = _client(server)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400)
    for text, content, reasoning, calls in CASES[name]:
        finish = "tool_calls" if calls else "stop"
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        got = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        assert (m.content or None, (m.model_extra or {}).get("reasoning_content") or None, got,
                r.choices[0].finish_reason) == (content, reasoning, calls, finish), text
        assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls or [])
        assert len({c.id for c in m.tool_calls or []}) == len(calls)

        s = _merge(client.chat.completions.create(stream=True, **kw))
        got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(s["calls"].items())]
        assert (s["content"], s["reasoning"], got, s["finish"]) == (content, reasoning, calls, finish), text
        assert sorted(s["calls"]) == list(range(len(calls)))
        assert all(c["id"] and c["id"].startswith("call_") for c in s["calls"].values())
