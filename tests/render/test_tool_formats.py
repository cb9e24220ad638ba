"""Each tool-call format from render to message (issue 33): tool_choice required, a named function and strict
tools are held by the format's grammar (an output in the family's real format fits it, one that breaks a
schema does not), and the postproc reads that output into the same calls streamed or not. The checkpoint
is tiny-chat with the format's special tokens added to its tokenizer, and its call syntax in its template
(what `--tool-parser auto` reads)."""
from __future__ import annotations

import json
import logging
import shutil

import llguidance
import msgspec
import pytest
from tokenizers import AddedToken, Tokenizer

from sluice.base.checkpoint import guidance_tokenizer
from sluice.base.config import ServerConfig
from sluice.base.tool_formats import reasoning_parser_of, tool_parser_of
from sluice.ipc.messages import PostprocSpec, RenderJob, Started, bytes_to_ids
from sluice.postproc.worker import Shard
from sluice.render.errors import RequestError
from sluice.render.worker import build_core
from tests.postproc.test_shard import feed, sse_events

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}

DS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
      "<｜tool▁sep｜>"]
# format: (its special tokens, a call to each tool as the family writes it ({w}, {t}: their arguments), the
# named call's output after the forced opening that the prompt holds)
FORMATS = {
    "hermes": ([], '<tool_call>\n{{"name": "get_weather", "arguments": {w}}}\n</tool_call>\n<tool_call>\n'
                   '{{"name": "get_time", "arguments": {t}}}\n</tool_call>', '{t}}}\n</tool_call>'),
    "llama3_json": (["<|python_tag|>"], '{{"name": "get_weather", "parameters": {w}}}; '
                                        '{{"name": "get_time", "parameters": {t}}}', "{t}}}"),
    "mistral": (["[TOOL_CALLS]", "[ARGS]"], '[TOOL_CALLS][{{"name": "get_weather", "arguments": {w}}}, '
                                            '{{"name": "get_time", "arguments": {t}}}]', "{t}}}]"),
    "granite": (["<|tool_call|>"], '<|tool_call|>[{{"name": "get_weather", "arguments": {w}}}, '
                                   '{{"name": "get_time", "arguments": {t}}}]', "{t}}}]"),
    "deepseek_v3": (DS, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                        "```json\n{w}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                        "```json\n{t}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "{t}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "qwen3_coder": ([], "<tool_call>\n<function=get_weather>\n{w}</function>\n</tool_call>\n<tool_call>\n"
                        "<function=get_time>\n{t}</function>\n</tool_call>", "{t}</function>\n</tool_call>"),
    "pythonic": ([], "[get_weather({w}), get_time({t})]", "{t})]"),
}
JSON_ARGS = ({"w": '{"city":"Paris","days":3}', "t": '{"tz":"utc"}'},
             {"w": '{"city":"Paris","days":9}', "t": '{"tz":"utc"}'})  # (days past its maximum)
ARGS = {  # (good, bad)
    "qwen3_coder": ({"w": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
                     "t": "<parameter=tz>\nutc\n</parameter>\n"},
                    {"w": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n9\n</parameter>\n",
                     "t": "<parameter=tz>\nutc\n</parameter>\n"}),
    "pythonic": ({"w": 'city="Paris", days=3', "t": 'tz="utc"'}, {"w": 'city="Paris", days=9', "t": 'tz="utc"'}),
}


def _output(parser: str, which: int, named: bool = False) -> str:
    return FORMATS[parser][2 if named else 1].format(**ARGS.get(parser, JSON_ARGS)[which])
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "utc"})]
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]",
           "granite": "<|tool_call|>", "deepseek_v3": DS[0], "qwen3_coder": "<tool_call><function=",
           "pythonic": "[func(arg=value)]"}


def _checkpoint(tiny_chat_dir, root, parser: str):
    """tiny-chat's tokenizer and template (no weights: render and postproc only) with the format's tokens."""
    path = root / parser
    path.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_chat_dir / name, path / name)
    tokenizer = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FORMATS.get(parser, [[]])[0]])
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = max(config["vocab_size"], tokenizer.get_vocab_size())
    (path / "config.json").write_text(json.dumps(config))
    template = (path / "chat_template.jinja").read_text().replace("<tool_call>", "<call>").replace("</tool_call>", "")
    (path / "chat_template.jinja").write_text(f"{{#- the model calls tools as {MARKERS[parser]} -#}}\n" + template)
    return path


@pytest.fixture(scope="module")
def checkpoints(tiny_chat_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {parser: _checkpoint(tiny_chat_dir, root, parser) for parser in MARKERS}


@pytest.fixture(scope="module")
def cores(checkpoints):
    return {parser: build_core(_config(path, tool_parser="auto" if parser != "pythonic" else parser))
            for parser, path in checkpoints.items()}  # (no template shows pythonic calls unmistakably)


def _config(path, **options) -> ServerConfig:
    return ServerConfig(model="m", model_path=str(path), served_model_names=["m"], runtime_dir="/tmp/x",
                        max_model_len=4096, **options)


def render(core, rid: str = "r1", reply_to: str = "ipc://r", **body):
    """The EngineRequest the render stage makes of a chat request for the weather (and the time) with TOOLS."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **body}
    return core.render(RenderJob(rid, "chat", json.dumps(body).encode(), reply_to, 1.0))


def _fits(path, request, text: str) -> bool:
    """Whether the grammar the request carries takes `text` whole (as the tokenizer spells it)."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    matcher = llguidance.LLMatcher(guidance_tokenizer(str(path), vocab), request.grammar, log_level=0)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def _message(path, request, text: str, stream: bool) -> tuple[list, str | None]:
    """(calls, finish_reason) of `text` read by the postproc as the request's output."""
    shard = Shard(Tokenizer.from_file(str(path / "tokenizer.json")))
    spec = msgspec.structs.replace(msgspec.msgpack.decode(request.postproc_spec, type=PostprocSpec),
                                   reply_to="ipc://r", stream=stream)
    data, _ = feed(shard, text, started=Started("r1", msgspec.msgpack.encode(spec), 5, 0), final="grammar")
    calls, finish, _ = read_answer(data, stream)
    return calls, finish


def read_answer(data: list[bytes], stream: bool) -> tuple[list, str | None, str]:
    """(calls as (name, arguments), finish_reason, content) of a chat answer's frames: the body, or the SSE
    events merged as a client merges them (each call's name and arguments by its index)."""
    if not stream:
        choice = json.loads(data[-1])["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return ([(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
                choice["finish_reason"], choice["message"].get("content") or "")
    merged: dict[int, list] = {}
    finish, content = None, ""
    for event in sse_events(data):
        if event == "[DONE]" or not event["choices"]:
            continue
        finish = event["choices"][0]["finish_reason"] or finish
        content += event["choices"][0]["delta"].get("content") or ""
        for delta in event["choices"][0]["delta"].get("tool_calls") or []:
            call = merged.setdefault(delta["index"], ["", ""])
            call[0] += delta["function"].get("name") or ""
            call[1] += delta["function"].get("arguments") or ""
    return [(name, json.loads(args)) for name, args in merged.values()], finish, content


def test_auto_chooses_each_format_from_the_template_and_says_so(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="sluice.render"):
        for parser, path in checkpoints.items():
            core = build_core(_config(path, tool_parser="auto"))
            assert core.ext.parsers() == ([parser] if parser != "pythonic" else [])
    assert "--tool-parser auto: mistral (from the chat template)" in caplog.text
    assert "--tool-parser auto: none" in caplog.text  # pythonic's template names no marker: no parser


@pytest.mark.parametrize("template, tool, reasoning", [
    ("{{ '<tool_call>' }} {{ '</think>' }} enable_thinking", "hermes", "qwen3"),
    ("<tool_call><function={{ name }}> enable_thinking </think>", "qwen3_coder", "qwen3"),
    ("<｜tool▁calls▁begin｜> <｜Assistant｜><think>\n </think>", "deepseek_v3", "think"),
    ("<|python_tag|> and [TOOL_CALLS]", None, None),  # two formats: ambiguous
    ("no format at all", None, None),
    ("<think> ... </think>", None, "think"),
])
def test_auto_reads_a_template_only_where_it_is_unambiguous(template, tool, reasoning):
    assert (tool_parser_of(template), reasoning_parser_of(template)) == (tool, reasoning)


@pytest.mark.parametrize("parser", FORMATS)
def test_required_holds_calls_in_the_format_and_the_postproc_reads_them(parser, checkpoints, cores):
    path, core = checkpoints[parser], cores[parser]
    text = _output(parser, 0)
    request = render(core, tool_choice="required")
    assert _fits(path, request, text) and not _fits(path, request, _output(parser, 1))
    assert not _fits(path, request, "I will not call a tool.")
    for stream in (False, True):
        assert _message(path, request, text, stream) == (CALLS, "tool_calls")
    one = render(core, tool_choice="required", parallel_tool_calls=False)
    assert not _fits(path, one, text)
    for stream in (False, True):  # (a second call is not read)
        assert _message(path, one, text, stream) == (CALLS[:1], "tool_calls")


@pytest.mark.parametrize("parser", FORMATS)
def test_a_named_function_is_forced_by_the_prompt_and_held_by_the_grammar(parser, checkpoints, cores):
    path, core = checkpoints[parser], cores[parser]
    request = render(core, tool_choice=NAMED)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = tokenizer.decode(bytes_to_ids(request.prompt_token_ids).tolist(), skip_special_tokens=False)
    assert prompt.endswith(core.ext.call_format.forced_prefix("get_time"))
    output = _output(parser, 0, named=True)
    assert _fits(path, request, output) and not _fits(path, request, output.replace("utc", "pst"))
    for stream in (False, True):
        assert _message(path, request, output, stream) == ([("get_time", {"tz": "utc"})], "tool_calls")


@pytest.mark.parametrize("parser", FORMATS)
def test_strict_tools_leave_text_free_and_hold_a_call_once_it_starts(parser, checkpoints, cores):
    path, core = checkpoints[parser], cores[parser]
    request = render(core)
    text = _output(parser, 0)
    lead = "" if parser in ("llama3_json", "granite", "pythonic") else "Let me check. "  # (else the whole output)
    assert _fits(path, request, "Paris is sunny.") and _fits(path, request, lead + text)
    assert not _fits(path, request, lead + _output(parser, 1))
    for stream in (False, True):
        assert _message(path, request, lead + text, stream) == (CALLS, "tool_calls")
        assert _message(path, request, "Paris is sunny.", stream) == ([], "stop")


@pytest.mark.parametrize("parser", FORMATS)
def test_strict_free_text_is_never_a_call_the_parser_reads(parser, checkpoints, cores):
    """Calls that break a schema, written without the format's tokens (granite's parser reads a bare `[` list
    too): the grammar refuses them, or the parser reads no call in them."""
    path, request = checkpoints[parser], render(cores[parser])
    bare = _output(parser, 1)
    for token in FORMATS[parser][0]:
        bare = bare.replace(token, "")
    for text in (bare, " \n" + bare):
        assert not _fits(path, request, text) or _message(path, request, text, False)[0] == [], text


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"])
def test_a_schema_qwen3_coder_cannot_hold_as_text_is_a_400_naming_tools(choice, cores):
    pattern = {**TIME, "properties": {"tz": {"type": "string", "pattern": "^[a-z]+$"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_time", "parameters": pattern, "strict": True}}]
    with pytest.raises(RequestError) as e:
        render(cores["qwen3_coder"], tool_choice=choice, tools=tools)
    assert e.value.status == 400 and e.value.param == "tools" and "qwen3_coder" in str(e.value), str(e.value)


def test_a_server_without_a_tool_parser_says_what_forcing_a_call_needs(checkpoints):
    core = build_core(_config(checkpoints["hermes"]))
    for choice, field in (("required", "tool_choice"), (NAMED, "tool_choice"), ("auto", "tools")):
        with pytest.raises(RequestError) as e:
            render(core, tool_choice=choice)
        assert e.value.status == 400 and e.value.param == field and "--tool-parser" in str(e.value)


def test_qwen3_coder_calls_come_back_with_their_schema_types(checkpoints, cores):
    path = checkpoints["qwen3_coder"]
    request = render(cores["qwen3_coder"], tools=[{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": False}}])
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    for stream in (False, True):
        assert _message(path, request, text, stream) == (CALLS[:1], "tool_calls")


def test_qwen3_coder_holds_each_value_as_its_parser_reads_it(checkpoints, cores):
    """A nullable string is text (never null), a nullable integer JSON (null too), a value with no type any
    text; a value the parser would misread (no type but not text, two types) is a 400."""
    path, core = checkpoints["qwen3_coder"], cores["qwen3_coder"]
    props = {"s": {"type": ["string", "null"], "maxLength": 5}, "n": {"type": ["integer", "null"]}, "any": {}}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": props, "required": list(props), "additionalProperties": False}}}
    request = render(core, tools=[tool], tool_choice="required")

    def call(s: str, n: str) -> str:
        return (f"<tool_call>\n<function=f>\n<parameter=s>\n{s}\n</parameter>\n<parameter=n>\n{n}\n</parameter>\n"
                "<parameter=any>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")

    assert _fits(path, request, call("null", "null")) and _fits(path, request, call("hi", "7"))
    assert not _fits(path, request, call("hi", "x")) and not _fits(path, request, call("toolong", "7"))
    for stream in (False, True):
        assert _message(path, request, call("null", "null"), stream)[0] == [("f", {"s": "null", "n": None,
                                                                                "any": "[1, 2]"})]
    for bad in ({"enum": [1, 2]}, {"type": ["integer", "string"]}, {"anyOf": [{"type": "integer"}]}):
        unholdable = {**tool, "function": {**tool["function"], "parameters": {"type": "object",
                                                                              "properties": {"x": bad}}}}
        with pytest.raises(RequestError) as e:
            render(core, tools=[unholdable], tool_choice="required")
        assert e.value.status == 400 and e.value.param == "tools"


def test_mistral_markers_survive_detokenization(checkpoints, cores):
    """[TOOL_CALLS] is a special token in Mistral's vocabulary: its output keeps special tokens to be read."""
    request = render(cores["mistral"], tools=[{**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": False}}])
    text = '[TOOL_CALLS]get_time[ARGS]{"tz": "utc"}'
    assert _message(checkpoints["mistral"], request, text, False) == (CALLS[1:], "tool_calls")
