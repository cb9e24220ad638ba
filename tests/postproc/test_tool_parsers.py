"""The tool-call parsers of the model families (llama3_json, mistral, qwen3_coder, deepseek_v3, pythonic,
granite) and the reasoning parsers deepseek_r1 and qwen3, on outputs in each family's own format: any
chunking of the text gives the calls the whole text gives."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.base.tool_formats import DS_CALL_BEGIN as CALL
from sluice.base.tool_formats import DS_CALL_END as END_CALL
from sluice.base.tool_formats import DS_CALLS_BEGIN as BEGIN
from sluice.base.tool_formats import DS_CALLS_END as END
from sluice.base.tool_formats import DS_SEP as SEP
from sluice.postproc.parsers import Piece, text_parser

WEATHER = {"city": "Paris", "days": 3}
TIME = {"tz": "utc"}
CALLS = [("get_weather", WEATHER), ("get_time", TIME)]
TYPES = {"get_weather": {"city": "string", "days": "integer"}, "get_time": {"tz": "string"}}

# (parser, the model's output, the content it holds): the calls are CALLS
OUTPUTS = {
    "llama3_json": ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                                   '{"name": "get_time", "parameters": {"tz": "utc"}}', ""),
    "llama3_json without the tag": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
                                                   ';{"name": "get_time", "parameters": {"tz": "utc"}}', ""),
    "mistral": ("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}'
                           '}, {"name": "get_time", "arguments": {"tz": "utc"}}]', "Let me look."),
    "mistral v11": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                               '{"tz": "utc"}', ""),
    "qwen3_coder": ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                   "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
                                   "<tool_call>\n<function=get_time>\n<parameter=tz>\nutc\n</parameter>\n</function>\n"
                                   "</tool_call>", "I will check.\n"),
    "deepseek_v3": ("deepseek_v3", f"Checking.{BEGIN}{CALL}function{SEP}get_weather\n```json\n"
                                   f'{{"city": "Paris", "days": 3}}\n```{END_CALL}\n{CALL}function{SEP}get_time\n'
                                   f'```json\n{{"tz": "utc"}}\n```{END_CALL}{END}', "Checking."),
    "deepseek_v3.1": ("deepseek_v3", f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 3}}{END_CALL}'
                                     f'{CALL}get_time{SEP}{{"tz": "utc"}}{END_CALL}{END}', ""),
    "pythonic": ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz="utc")]', ""),
    "pythonic (Llama 4)": ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3), get_time(tz=\'utc\')]'
                                       "<|python_end|>", ""),
    "granite": ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                           '{"name": "get_time", "arguments": {"tz": "utc"}}]', ""),
}


def deltas(name: str, chunks: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, str]], list[int]]:
    """(content, each call's (name, arguments text) as its deltas add up, the chunk at which each call began)."""
    parser = text_parser(name, max_calls is None, TYPES)
    content, calls, when = "", list[list[str]](), []
    for i, chunk in enumerate(chunks):
        piece = parser.feed(Piece(content=chunk), final=i == len(chunks) - 1)
        content += piece.content
        for call in piece.tool_calls:
            if call.id:  # a new call
                assert call.index == len(calls) and call.function.name
                calls.append(["", ""])
                when.append(i)
            assert call.index == len(calls) - 1  # (a call's deltas come together)
            calls[-1][0] += call.function.name or ""
            calls[-1][1] += call.function.arguments or ""
    return content, [(n, a) for n, a in calls], when


def run(name: str, chunks: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, dict]], list[int]]:
    """(content, calls, the chunk at which each call began)."""
    content, calls, when = deltas(name, chunks, max_calls)
    return content, [(n, json.loads(a)) for n, a in calls], when


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("case", OUTPUTS)
def test_each_format_gives_its_calls_and_its_content_whole_or_a_character_at_a_time(case):
    name, text, content = OUTPUTS[case]
    assert run(name, [text])[:2] == (content, CALLS)
    assert run(name, list(text))[:2] == (content, CALLS)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(sorted(OUTPUTS)), cuts=st.lists(st.integers(0, 400), max_size=25),
       cut_short=st.integers(0, 400), lead=st.text(st.sampled_from("ab .\n[{<"), max_size=6))
def test_any_chunking_gives_what_the_whole_text_gives(case, cuts, cut_short, lead):
    """Also with any text before the calls, and for the output cut anywhere (max_tokens): the same whatever
    the chunking."""
    name, text, _ = OUTPUTS[case]
    text = lead + text
    for t in (text, text[: cut_short % (len(text) + 1)]):
        assert deltas(name, chunks_of(t, cuts))[:2] == deltas(name, [t])[:2]


# Outputs that stream a call and then break the format, or that a streaming start could misread: their calls
# and content are whatever the whole text gives, but the same for any chunking.
ODD = [
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, }; {"name": "g", "parameters": {}}'),
    ("llama3_json", '{"parameters": {"a": 1}, "name": "f"}; {"name": "g", "parameters": "{\\"b\\": 2}"}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "x": tru'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1} junk[TOOL_CALLS]g[ARGS] {"b": "]"}'),
    ("granite", '<|tool_call|>[{"name": "f\\"", "arguments": {"a": "}]"}}, {"name": "g", "arguments": {}}] after'),
    ("deepseek_v3", f'{BEGIN}{CALL}f{SEP}{{"a": "{END_CALL}"}}{END_CALL}{CALL}g{SEP}{{"b": 1}} x{END_CALL}{END}z'),
    ("deepseek_v3", f'{BEGIN}{CALL}function{SEP}f\n```json\n{{"a": 1, ]\n```{END_CALL}{END}'),
    ("deepseek_v3", f'{BEGIN}{CALL}function{SEP}{{"a":\n```json\n{{"b": 2}}\n```{END_CALL}{END}'),
    ("deepseek_v3", f'{BEGIN}{CALL}f{SEP}"x"{END_CALL}{CALL}g{SEP}{{"b": 1}}{END_CALL}{END}'),
]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ODD), cuts=st.lists(st.integers(0, 120), max_size=25), cut_short=st.integers(0, 120))
def test_odd_outputs_give_the_same_for_any_chunking(case, cuts, cut_short):
    name, text = case
    for t in (text, text[: cut_short % (len(text) + 1)]):
        assert deltas(name, chunks_of(t, cuts))[:2] == deltas(name, [t])[:2]


@pytest.mark.parametrize("case", ["mistral", "mistral v11", "qwen3_coder", "deepseek_v3", "granite", "llama3_json"])
def test_a_call_streams_out_as_soon_as_it_is_complete(case):
    name, text, _ = OUTPUTS[case]
    _, calls, when = run(name, list(text))
    assert len(calls) == 2 and when[0] < when[1] <= len(text) - 1 and when[0] < len(text) * 0.8


STREAMED = ["llama3_json", "llama3_json without the tag", "mistral", "mistral v11", "granite", "deepseek_v3",
            "deepseek_v3.1"]


@pytest.mark.parametrize("case", STREAMED)
def test_json_arguments_stream_as_the_model_writes_them(case):
    """The call's name as soon as it is read, then its arguments' text as it comes (as vLLM streams them):
    fed a character at a time, the first call opens before its arguments end, and they come in pieces
    that add up to the text the model wrote."""
    name, text, _ = OUTPUTS[case]
    parser = text_parser(name, True, TYPES)
    pieces = [parser.feed(Piece(content=c), final=i == len(text) - 1) for i, c in enumerate(text)]
    first = [(i, call) for i, p in enumerate(pieces) for call in p.tool_calls if call.index == 0]
    assert first[0][1].function.name == "get_weather" and first[0][1].function.arguments == ""
    arguments = [call.function.arguments for _, call in first[1:]]
    assert len(arguments) > 10 and "".join(arguments) == '{"city": "Paris", "days": 3}'
    assert first[0][0] < text.index('"Paris"') and first[-1][0] == text.index("}")


@pytest.mark.parametrize("case", OUTPUTS)
def test_without_parallel_calls_only_the_first_call_is_read(case):
    name, text, _ = OUTPUTS[case]
    content, calls, _ = run(name, list(text), max_calls=1)
    assert calls == CALLS[:1]


@pytest.mark.parametrize("name, text", [
    ("llama3_json", "Paris is sunny {today}."),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("mistral", "no calls at all [not one]"),
    ("mistral", '[TOOL_CALLS] sorry, {"name": 1}'),
    ("qwen3_coder", "<tool_call>\n<fun=x>\n</tool_call> and text"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\nnot json\n```"
                    "<｜tool▁call▁end｜>"),
    ("pythonic", "[1] is a citation, [2] another."),
    ("pythonic", '[f(a=__import__("os").system("echo pwned"))]'),  # read with ast, never run
    ("pythonic", "[f(1, 2)]"),  # positional arguments: not a call the API can carry
    ("granite", "[see the docs]"),
    ("granite", "Plain text."),
])
def test_text_that_is_not_a_call_comes_back_as_content(name, text, capfd):
    for chunks in ([text], list(text)):
        assert run(name, chunks)[:2] == (text, [])
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize("name, text", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "argum'),
    ("llama3_json", '{"name": "get_weather", "parameters": '),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
])
def test_a_call_cut_short_before_its_arguments_comes_back_as_content(name, text):
    assert run(name, list(text))[:2] == (text, [])


@pytest.mark.parametrize("name, text, after", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', ""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', ""),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', ""),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Par', ""),
    ("deepseek_v3", f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Par', ""),
    ("deepseek_v3", f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Par<｜tool▁call', "<｜tool▁call"),
])
def test_a_call_cut_short_in_its_arguments_keeps_what_streamed(name, text, after):
    """(As hermes and vLLM: its start has gone out.) What may have been the start of the call's end marker
    is not arguments."""
    for chunks in ([text], list(text)):
        assert deltas(name, chunks)[:2] == (after, [("get_weather", '{"city": "Par')])


def test_qwen3_coder_reads_each_value_as_its_schema_type_says():
    types = {"f": {"n": "integer", "x": "number", "b": "boolean", "o": "object", "a": "array", "s": "string",
                   "z": "null"}}
    params = {"n": "42", "x": "2.5", "b": "True", "o": '{"k": [1]}', "a": "[1, 2]", "s": "42", "z": "null",
              "unknown": "7", "bad_n": "many"}
    types["f"]["bad_n"] = "integer"
    text = "<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) \
        + "</function>\n</tool_call>"
    parser = text_parser("qwen3_coder", True, types)
    (call,) = parser.feed(Piece(content=text), final=True).tool_calls
    assert json.loads(call.function.arguments) == {"n": 42, "x": 2.5, "b": True, "o": {"k": [1]}, "a": [1, 2],
                                                   "s": "42", "z": None, "unknown": "7", "bad_n": "many"}


def test_pythonic_reads_python_and_json_literals():
    text = "[f(a=-1, b=True, c=None, d=null, e=[1, (2, 3)], g={'k': 'v'}, h=\"x]y\"), mod.g()]"
    _, calls, _ = run("pythonic", list(text))
    assert calls == [("f", {"a": -1, "b": True, "c": None, "d": None, "e": [1, [2, 3]], "g": {"k": "v"},
                            "h": "x]y"}), ("mod.g", {})]


# ---- reasoning ----------------------------------------------------------------------------------------------

def reason(name: str, chunks: list[str]) -> tuple[str, str]:
    parser = text_parser(name)
    out = Piece()
    for i, chunk in enumerate(chunks):
        out.extend(parser.feed(Piece(content=chunk), final=i == len(chunks) - 1))
    return out.reasoning, out.content


@pytest.mark.parametrize("text, expected", [
    ("I ponder.</think>The answer.", ("I ponder.", "The answer.")),  # the template opened <think>
    ("<think>I ponder.</think>The answer.", ("I ponder.", "The answer.")),
    ("\n<think>\nI ponder.</think>The answer.", ("\nI ponder.", "The answer.")),
    ("Still pondering", ("Still pondering", "")),  # cut short: all of it is reasoning
    ("<thin", ("<thin", "")),
])
def test_deepseek_r1_reads_all_before_the_close_as_reasoning(text, expected):
    assert reason("deepseek_r1", [text]) == expected == reason("deepseek_r1", list(text))


@pytest.mark.parametrize("text, expected", [
    ("<think>I ponder.</think>The answer.", ("I ponder.", "The answer.")),
    ("The answer, without thinking.", ("", "The answer, without thinking.")),  # enable_thinking false
])
def test_qwen3_reads_its_think_block_and_an_answer_without_one_is_content(text, expected):
    assert reason("qwen3", [text]) == expected == reason("qwen3", list(text))


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.sampled_from("ab <>/think\n"), max_size=40), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_reasoning_parsers_are_independent_of_chunking(text, cuts):
    for name in ("deepseek_r1", "qwen3"):
        assert reason(name, chunks_of(text, cuts)) == reason(name, [text])
