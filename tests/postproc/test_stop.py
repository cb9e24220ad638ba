"""Stop strings give the same result however the text is chunked."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from postproc.stop import StopStrings

alphabet = st.sampled_from("abc xy\n")


def one_shot(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    i, s = min(hits)
    return text[: i + len(s)] if include else text[:i], True


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@given(text=st.text(alphabet, max_size=60), stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 100), max_size=20), include=st.booleans())
def test_any_chunking_matches_one_shot(text, stops, cuts, include):
    checker = StopStrings(stops, include)
    out = "".join(checker.feed(c) for c in chunked(text, cuts))
    if not checker.stopped:
        out += checker.flush()
    assert (out, checker.stopped) == one_shot(text, stops, include)


def test_partial_match_is_held_back_until_decided():
    c = StopStrings(["STOP"])
    assert c.feed("hello ST") == "hello "
    assert c.feed("AR") == "STAR"
    assert c.feed("t STO") == "t "
    assert c.feed("P and more") == "" and c.stopped
