"""Stop strings give the same result however the text is chunked."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.postproc.stop import StopStrings

alphabet = st.sampled_from("abc xy\n")


def one_shot(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """Grows the text one character at a time and stops at the first stop string to complete."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:end] if include else text[: end - len(s)], True
    return text, False


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=500)
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
