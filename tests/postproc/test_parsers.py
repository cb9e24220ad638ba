"""Output parsers: chunking independence, and streaming equals non-streaming."""
from __future__ import annotations

import json
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyError, Role, StreamableParser

from sluice.base.harmony_vocab import harmony_encoding
from sluice.ipc.messages import PostprocSpec, Started
from sluice.postproc.assembly import Assembly
from sluice.postproc.harmony import HarmonyParser
from sluice.postproc.openai_frames import _message
from sluice.postproc.parsers import HermesParser, Piece, ThinkParser
from sluice.postproc.request import RequestOutput
from tests.harmony_outputs import harmony_tokens

words = st.text(st.sampled_from("ab <>/{}\"x\n"), max_size=12)
calls = st.builds(lambda n, a: ("call", n, a), st.sampled_from(["get_weather", "add"]),
                  st.dictionaries(st.sampled_from(["city", "x"]), st.integers(0, 9) | st.text("xy", max_size=3),
                                  max_size=2))
segments = st.lists(st.tuples(st.just("text"), words) | st.tuples(st.just("think"), words) | calls, max_size=6)


def _render(segs) -> str:
    out = []
    for seg in segs:
        if seg[0] == "text":
            out.append(seg[1])
        elif seg[0] == "think":
            out.append(f"<think>{seg[1]}</think>")
        else:
            out.append("<tool_call>" + json.dumps({"name": seg[1], "arguments": seg[2]}) + "</tool_call>")
    return "".join(out)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _run_text(text: str, cuts: list[int]) -> Assembly:
    parsers = [ThinkParser(), HermesParser()]
    merged = Assembly(trim=False)
    pieces = _chunks(text, cuts)
    for i, chunk in enumerate(pieces):
        piece = Piece(content=chunk)
        for p in parsers:
            piece = p.feed(piece, final=i == len(pieces) - 1)
        merged.feed(piece)
    return merged


@settings(max_examples=300, deadline=None)
@given(segs=segments, cuts=st.lists(st.integers(0, 400), max_size=30))
def test_text_parsers_are_independent_of_chunking(segs, cuts):
    text = _render(segs)
    one, many = _message(_run_text(text, [])), _message(_run_text(text, cuts))
    for m in (one, many):
        for c in m.tool_calls:
            c.id = "x"
    assert one == many
    expected_calls = [(s[1], s[2]) for s in segs if s[0] == "call"]
    # whatever the text around them, well-formed calls are found (stray tags in text can swallow some)
    if not any(ch in s[1] for s in segs if s[0] != "call" for ch in "<>"):
        assert [(c.function.name, json.loads(c.function.arguments)) for c in one.tool_calls] == expected_calls
        assert one.reasoning_content == ("".join(s[1] for s in segs if s[0] == "think") or None)


def test_hermes_streams_a_call_name_first_then_its_arguments():
    parser = HermesParser()
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
    deltas = [parser.feed(Piece(content=text[i : i + 3]), final=i + 3 >= len(text)).tool_calls
              for i in range(0, len(text), 3)]
    first = next(i for i, d in enumerate(deltas) if d)
    head = deltas[first][0]
    assert (head.function.name, head.function.arguments, head.index) == ("get_weather", "", 0) and head.id
    assert text.index('"arguments"') < 3 * first + 3 <= text.index("{", text.index('"arguments"')) + 3
    pieces = [d.function.arguments for ds in deltas for d in ds][1:]
    assert len(pieces) > 5 and all(d.index == 0 and d.id is None for ds in deltas for d in ds[1:])
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": [1, 2]}
    assert all("\n" not in p for p in pieces[-2:])  # the block's own closing brace never goes out


@pytest.mark.parametrize("block", [
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # arguments first
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as a string
])
def test_hermes_reads_other_call_layouts_whole(block):
    parser = HermesParser()
    text = f"<tool_call>{block}</tool_call>"
    deltas = [parser.feed(Piece(content=ch)).tool_calls for ch in text]
    assert not any(deltas[:-1]) and len(deltas[-1]) == 1
    call = deltas[-1][0].function
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_hermes_gives_back_a_malformed_call_as_text():
    piece = HermesParser().feed(Piece(content='hi <tool_call>{"nope": 1}</tool_call> <tool_call>{"na'), final=True)
    assert piece.tool_calls == [] and piece.content == 'hi <tool_call>{"nope": 1}</tool_call> <tool_call>{"na'
    bad_name = '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>'  # \q: not a JSON escape
    piece = HermesParser().feed(Piece(content=bad_name), final=True)
    assert piece.tool_calls == [] and piece.content == bad_name


# ---- harmony -------------------------------------------------------------------

harmony_texts = st.text(st.sampled_from("abc xyz.,!?\n"), min_size=1, max_size=20)
harmony_messages = st.lists(
    st.tuples(st.just("analysis"), harmony_texts) | st.tuples(st.just("call"), st.sampled_from(["get_weather", "add"]),
                                                               st.dictionaries(st.sampled_from(["city", "n"]),
                                                                               st.integers(0, 99), max_size=2)),
    max_size=3,
).flatmap(lambda head: st.just(head) | harmony_texts.map(lambda t: head + [("final", t)]))


def _spec(stream: bool) -> PostprocSpec:
    return PostprocSpec(request_id="r", endpoint="chat", model="m", created=1, reply_to="x", stream=stream,
                        output_mode="tokens", parsers=["harmony"])


def _sse_message(data: bytes) -> dict:
    merged = {"content": "", "reasoning": "", "calls": {}}
    for event in data.decode().split("\n\n"):
        if not event.startswith("data: {"):
            continue
        for choice in json.loads(event[6:])["choices"]:
            d = choice["delta"]
            merged["content"] += d.get("content") or ""
            merged["reasoning"] += d.get("reasoning_content") or ""
            for c in d.get("tool_calls") or []:
                call = merged["calls"].setdefault(c["index"], {"name": None, "arguments": ""})
                call["name"] = c["function"].get("name") or call["name"]
                call["arguments"] += c["function"].get("arguments") or ""
            merged["finish"] = choice["finish_reason"] or merged.get("finish")
    return merged


def _feed(stream: bool, tokens: list[int]) -> bytes:
    req = RequestOutput(_spec(stream), None, Started("r", b"", 3), str)
    data = b""
    for i, tok in enumerate(tokens):
        verdict = "stop_token" if i == len(tokens) - 1 else None
        data += req.on_token(0, tok, verdict, None)
    return data + req.final().data


@settings(max_examples=60, deadline=None)
@given(msgs=harmony_messages.filter(bool))
def test_harmony_streaming_equals_non_streaming_equals_harmony(msgs):
    tokens = harmony_tokens(msgs)
    body = json.loads(_feed(False, tokens))["choices"][0]
    streamed = _sse_message(_feed(True, tokens))
    message = body["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    assert streamed["finish"] == body["finish_reason"]
    # and what harmony itself parses from the same tokens
    parsed = harmony_encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
    assert calls == [(m.recipient.removeprefix("functions."), m.content[0].text) for m in parsed
                     if (m.recipient or "").startswith("functions.")]
    assert (message["content"] or "") == "".join(m.content[0].text for m in parsed if m.channel == "final")
    assert (message.get("reasoning_content") or "") == "".join(m.content[0].text for m in parsed
                                                             if m.channel == "analysis")
    assert body["finish_reason"] == ("tool_calls" if calls else "stop")
    assert "<|" not in (message["content"] or "")


def test_malformed_harmony_ends_the_choice_with_what_was_parsed():
    enc = harmony_encoding()
    good = harmony_tokens([("analysis", "thinking")])[:-1]  # the analysis message, without its <|end|>
    bad = good + [200007, 200008, 200008, 200005]  # then nonsense markup
    req = RequestOutput(_spec(False), None, Started("r", b"", 3), str)
    for tok in bad:
        req.on_token(0, tok, None, None)
        if req.done:
            break
    body = json.loads(req.final().data)["choices"][0]
    assert body["finish_reason"] == "error" and body["message"]["reasoning_content"] == "thinking"
    assert req.choices[0].finish_reason == "error" and enc is not None


def test_forced_tool_call_prefix_is_parsed_not_shown():
    enc = harmony_encoding()
    prefix = enc.encode("<|channel|>commentary to=functions.add <|constrain|>json<|message|>", allowed_special="all")
    spec = msgspec.structs.replace(_spec(False), output_prefix=prefix)
    req = RequestOutput(spec, None, Started("r", b"", 3), str)
    tokens = enc.encode('{"a": 1}', allowed_special="all") + [200012]
    for i, tok in enumerate(tokens):
        req.on_token(0, tok, "stop_token" if i == len(tokens) - 1 else None, None)
    choice = json.loads(req.final().data)["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


@pytest.mark.parametrize("tokens", [[1, 2, 3], [200005, 200005], [200008, 5, 200007]])
def test_harmony_parser_never_raises(tokens):
    parser = HarmonyParser(harmony_encoding())
    for t in tokens:
        parser.feed(t)


def _reads_as_harmony(tokens: list[int]) -> None:
    """HarmonyParser gives, token by token, the deltas harmony's own StreamableParser gives, of the same kind
    (content, reasoning, a call's arguments), has named each call by the time its message ends, and fails where
    harmony raises."""
    enc = harmony_encoding()
    ours, theirs = HarmonyParser(enc), StreamableParser(enc, role=Role.ASSISTANT)
    named, ended = [], 0  # the calls ours named; the messages harmony ended
    for token in tokens:
        piece = ours.feed(token)
        named += [c.function.name for c in piece.tool_calls if c.id and c.function]
        try:
            theirs.process(token)
        except HarmonyError:
            assert ours.failed
            return
        assert not ours.failed
        if token in enc.stop_tokens() and len(messages := theirs.messages) > ended:
            ended = len(messages)
            calls = [m.recipient[len("functions."):] for m in messages if (m.recipient or "").startswith("functions.")]
            assert named == calls
        delta = theirs.last_content_delta or ""
        arguments = "".join(c.function.arguments or "" for c in piece.tool_calls if c.function)
        if (theirs.current_recipient or "").startswith("functions."):
            assert (piece.content, piece.reasoning, arguments) == ("", "", delta)
        elif theirs.current_channel == "analysis":
            assert (piece.content, piece.reasoning, arguments) == ("", delta, "")
        else:
            assert (piece.content, piece.reasoning, arguments) == (delta, "", "")


# Markup, header words, content text (a character in two tokens), a lone UTF-8 continuation byte (95), an id
# outside the vocabulary (201100).
HARMONY_STRAYS = ["<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>",
                  "assistant", "analysis", "final", "commentary", " to=functions.add", " json", " hi", "\U0001f980",
                  95, 201100]


def _ids(part: str | int) -> list[int]:
    return [part] if isinstance(part, int) else harmony_encoding().encode(part, allowed_special="all")


def test_harmony_parser_reads_any_stray_or_missing_token_as_harmony_does():
    base = harmony_tokens([("analysis", "h\u00e9llo"), ("call", "add", {"n": 1}), ("commentary", "so"),
                           ("final", "done \U0001f980")])
    for k in range(len(base) + 1):
        _reads_as_harmony(base[:k] + base[k + 1:])
        for stray in HARMONY_STRAYS:
            _reads_as_harmony(base[:k] + _ids(stray) + base[k:])


@settings(max_examples=100, deadline=None)
@given(head=harmony_messages, soup=st.lists(st.sampled_from(HARMONY_STRAYS) | harmony_messages.filter(bool),
                                            max_size=8))
def test_harmony_parser_reads_any_markup_as_harmony_does(head, soup):
    tokens = harmony_tokens(head) if head else []
    for part in soup:  # whole messages, or strays
        tokens += _ids("<|start|>assistant") + harmony_tokens(part) if isinstance(part, list) else _ids(part)
    _reads_as_harmony(tokens)


TWO_CALLS = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call> trailing text')


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, len(TWO_CALLS) - 1), unique=True).map(sorted))
def test_hermes_with_one_call_allowed_reads_the_first_call_only(cuts):
    parser = HermesParser(max_calls=1)
    pieces = [TWO_CALLS[i:j] for i, j in zip([0, *cuts], [*cuts, len(TWO_CALLS)])]
    out = Assembly(trim=False)
    for i, text in enumerate(pieces):
        out.feed(parser.feed(Piece(content=text), final=i == len(pieces) - 1))
    message = _message(out)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("a", {"x": 1})]
    assert parser.done and (message.content or "").strip() == ""


_unicode_texts = st.text(st.sampled_from("ab .\u00e9\u4e2d\U0001f980\n\""), min_size=1, max_size=12)
_unicode_messages = st.lists(st.tuples(st.sampled_from(["analysis", "final", "commentary"]), _unicode_texts)
                             | st.tuples(st.just("call"), st.sampled_from(["add"]), st.just({"n": 1})),
                             min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(head=_unicode_messages, soup=st.lists(st.sampled_from(HARMONY_STRAYS) | _unicode_messages, max_size=4),
       steps=st.lists(st.integers(1, 9), max_size=40), ends=st.booleans(), interval=st.sampled_from([1, 1, 3]),
       lead_bytes=st.lists(st.integers(0, 1000), max_size=2))
def test_lean_harmony_tokens_frame_as_every_other_token_does(head, soup, steps, ends, interval, lead_bytes):
    """The tokens that only add text, and the chunks of such text, take a shorter way through a streamed harmony
    output (RequestOutput's lean path, the framer's text_chunk): the same frames, counts and final frame as the
    whole way, for any output cut into any steps (characters split over tokens, a lone lead byte before whole
    characters too; a step across messages)."""
    tokens = harmony_tokens(head)
    for part in soup:
        tokens += _ids("<|start|>assistant") + harmony_tokens(part) if isinstance(part, list) else _ids(part)
    for at in lead_bytes:
        tokens.insert(at % len(tokens), 172)  # the byte 0xf0 alone
    spec = msgspec.structs.replace(_spec(True), stream_interval=interval)
    with mock.patch("sluice.postproc.harmony.new_call_id", lambda: "call_x"):  # (the one thing drawn at random)
        _frame_lean_and_whole(spec, tokens, steps, ends)


def _frame_lean_and_whole(spec: PostprocSpec, tokens: list[int], steps: list[int], ends: bool) -> None:
    lean, whole = (RequestOutput(spec, None, Started("r", b"", 3), str) for _ in range(2))
    assert lean._lean and (lean._text_chunk is not None) == (spec.stream_interval == 1)
    whole._lean, whole._text_chunk = False, None
    sizes = iter(steps)
    i = 0
    while i < len(tokens):  # a step's worth of tokens, then a chunk: what a shard does with each request
        n = next(sizes, 1)
        for k, tok in enumerate(tokens[i:i + n]):
            verdict = "stop_token" if ends and i + k == len(tokens) - 1 else None
            assert lean.feed(0, tok, verdict, None, [], 1.0 + i + k) == whole.feed(0, tok, verdict, None, [],
                                                                                     1.0 + i + k)
        assert lean.chunk(0) == whole.chunk(0)
        i += n
    a, b = lean.choices[0], whole.choices[0]
    assert (a.num_tokens, a.reasoning_tokens, a.finish_reason) == (b.num_tokens, b.reasoning_tokens, b.finish_reason)
    if lean.done:
        assert lean.final().data == whole.final().data


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_lean_chunks_of_reasoning_and_content_in_one_step(include_reasoning):
    """A step that ends the reasoning and starts the answer: its chunk holds both kinds (not a text chunk)."""
    tokens = harmony_tokens([("analysis", "think it over"), ("final", "the answer"), ("analysis", "more")])
    spec = msgspec.structs.replace(_spec(True), include_reasoning=include_reasoning)
    for cut in range(1, len(tokens)):  # (the first step opens the reasoning and shows some of it)
        _frame_lean_and_whole(spec, tokens, [4, cut], ends=True)
