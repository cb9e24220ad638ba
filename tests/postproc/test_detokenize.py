"""Incremental detokenization equals a one-shot decode."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

TEXTS = ["Hello world, café 東京 😀 naïve → ∑", "def add(a, b): return a + b", "  spaces\n\nnew lines\t",
         '{"name": "get_weather"}']


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))


def _stream(tokenizer, ids, skip_special=True):
    ds = DecodeStream(skip_special_tokens=skip_special)
    return "".join(ds.step(tokenizer, i) or "" for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_of_real_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert _stream(tokenizer, ids) == tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def whole_char_ids(tokenizer):
    """Tokens that are whole characters on their own (not a fragment of a UTF-8 sequence)."""
    return [i for i in range(tokenizer.get_vocab_size()) if "\ufffd" not in tokenizer.decode([i])]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_sequence_of_whole_tokens(tokenizer, whole_char_ids, data):
    ids = data.draw(st.lists(st.sampled_from(whole_char_ids), max_size=40))
    for skip in (True, False):
        assert _stream(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.sampled_from(TEXTS + ["<|im_end|>", "x", " ", "é"]), max_size=8))
def test_concatenated_real_texts_round_trip(tokenizer, texts):
    text = "".join(texts)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert _stream(tokenizer, ids, skip_special=False) == tokenizer.decode(ids, skip_special_tokens=False)
