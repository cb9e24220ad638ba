"""The one assembly under every dialect: pieces in, items out, the same items for any grouping of the same
pieces; whitespace between items makes none (itemised dialects) or is kept verbatim (OpenAI's content)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.postproc.assembly import Assembly, Events, Item
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import FunctionCallOut, ToolCallOut


def _call(index: int, name: str, arguments: str = "{}") -> ToolCallOut:
    return ToolCallOut(index=index, id=f"call_{index}", type="function", function=FunctionCallOut(name, arguments))


def _more(index: int, arguments: str) -> ToolCallOut:
    return ToolCallOut(index=index, function=FunctionCallOut(None, arguments))


def _items(pieces: list[Piece], trim: bool = True) -> list[tuple]:
    a = Assembly(trim=trim)
    for p in pieces:
        a.feed(p)
    a.finish()
    return [(i.kind, i.text, i.call_id, i.name) for i in a.items]


def test_whitespace_between_and_after_calls_makes_no_item():
    pieces = [Piece(content="Sure.\n"), Piece(tool_calls=[_call(0, "a")]), Piece(content="\n"),
              Piece(tool_calls=[_call(1, "b")]), Piece(content="\n")]
    assert _items(pieces) == [("text", "Sure.", "", ""), ("tool_call", "{}", "call_0", "a"),
                              ("tool_call", "{}", "call_1", "b")]
    assert _items(pieces, trim=False) == [("text", "Sure.\n", "", ""), ("tool_call", "{}", "call_0", "a"),
                                          ("text", "\n", "", ""), ("tool_call", "{}", "call_1", "b"),
                                          ("text", "\n", "", "")]


def test_the_last_item_keeps_its_trailing_whitespace_and_an_item_begins_with_none():
    assert _items([Piece(reasoning="\n think "), Piece(content="\n\nHello"), Piece(content=" world \n")]) == [
        ("reasoning", "think", "", ""), ("text", "Hello world \n", "", "")]


def test_a_piece_is_read_as_the_open_calls_arguments_then_reasoning_text_and_new_calls():
    pieces = [Piece(tool_calls=[_call(0, "f", '{"a"')]),
              Piece(content="Then.", tool_calls=[_more(0, ": 1}"), _call(1, "g")])]
    assert _items(pieces) == [("tool_call", '{"a": 1}', "call_0", "f"), ("text", "Then.", "", ""),
                              ("tool_call", "{}", "call_1", "g")]


def test_events_tell_each_item_opened_added_to_and_closed_in_order():
    told: list[tuple] = []

    class Told(Events):
        def opened(self, index: int, item: Item) -> None:
            told.append(("opened", index, item.kind))

        def added(self, index: int, item: Item, text: str) -> None:
            told.append(("added", index, text))

        def closed(self, index: int, item: Item) -> None:
            told.append(("closed", index, item.text))

    a = Assembly(Told())
    for p in [Piece(reasoning="r"), Piece(content="a "), Piece(content="b"), Piece(tool_calls=[_call(0, "f")])]:
        a.feed(p)
    a.finish()
    assert told == [("opened", 0, "reasoning"), ("added", 0, "r"), ("closed", 0, "r"), ("opened", 1, "text"),
                    ("added", 1, "a"), ("added", 1, " b"), ("closed", 1, "a b"), ("opened", 2, "tool_call"),
                    ("added", 2, "{}"), ("closed", 2, "{}")]


_TEXT = st.text(alphabet="ab \n.", max_size=8)
_PART = st.one_of(st.builds(lambda t: ("reasoning", t), _TEXT), st.builds(lambda t: ("text", t), _TEXT),
                  st.builds(lambda t: ("call", t), st.sampled_from(["{", '"x": 1', "}", ""])))


def _pieces(parts: list[tuple[str, str]], splits: list[int]) -> list[Piece]:
    """The parts as a model writes them (a call: its first part opens it, the next ones continue it), each
    text cut at the given places into per-token pieces."""
    pieces, calls, last = [], -1, None
    for kind, text in parts:
        if kind == "call":
            if last != "call":
                calls += 1
                pieces.append(Piece(tool_calls=[_call(calls, "f", text)]))
            else:
                pieces.append(Piece(tool_calls=[_more(calls, text)]))
        else:
            cuts = sorted({s % (len(text) + 1) for s in splits} | {0, len(text)})
            pieces += [Piece(**{"reasoning" if kind == "reasoning" else "content": text[i:j]})
                       for i, j in zip(cuts, cuts[1:])]
        last = kind
    return pieces


def _merged(pieces: list[Piece], groups: list[int]) -> list[Piece]:
    """Consecutive pieces of text of one kind merged, as a frame of several tokens merges them."""
    out: list[Piece] = []
    for i, p in enumerate(pieces):
        if out and i % max(1, groups[i % len(groups)] if groups else 1) and not p.tool_calls \
                and not out[-1].tool_calls and bool(p.reasoning) == bool(out[-1].reasoning) \
                and bool(p.content) == bool(out[-1].content):
            out[-1].extend(p)
        else:
            out.append(Piece(p.content, p.reasoning, list(p.tool_calls)))
    return out


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_PART, max_size=8), splits=st.lists(st.integers(0, 8), max_size=3),
       groups=st.lists(st.integers(1, 4), max_size=4))
def test_any_grouping_of_the_same_pieces_gives_the_same_items(parts, splits, groups):
    whole = _pieces(parts, [])
    for trim in (True, False):
        assert _items(_pieces(parts, splits), trim) == _items(whole, trim)
        assert _items(_merged(_pieces(parts, splits), groups), trim) == _items(whole, trim)
    verbatim = _items(whole, trim=False)
    assert "".join(t for k, t, *_ in verbatim if k == "text") == "".join(t for k, t in parts if k == "text")
    for kind, text, *_ in _items(whole):
        assert kind == "tool_call" or (text and text == text.lstrip())
