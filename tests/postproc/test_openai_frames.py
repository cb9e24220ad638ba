"""OpenAI chat chunks."""
from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.ipc.messages import PostprocSpec
from sluice.postproc.openai_frames import OpenAIFramer
from sluice.postproc.parsers import Piece
from sluice.schemas.openai import ChatCompletionChunk, ChunkChoice, Delta


@settings(max_examples=100, deadline=None)
@given(text=st.text(), reasoning=st.booleans(), index=st.integers(0, 2))
def test_a_chunk_of_text_alone_is_the_whole_chunk_encoded(text, reasoning, index):
    spec = PostprocSpec(request_id="r", endpoint="chat", model="m", created=1, reply_to="x", stream=True, n=3)
    framer = OpenAIFramer(spec, 3, 0, str)
    framer.chunk(index, Piece(), None, [], [])  # the choice's opening chunk
    piece = Piece(reasoning=text) if reasoning else Piece(content=text)
    delta = Delta(reasoning_content=text) if reasoning else Delta(content=text)
    whole = ChatCompletionChunk(id="r", object="chat.completion.chunk", created=1, model="m",
                                choices=[ChunkChoice(index, delta)], usage=None)
    expected = b"data: " + msgspec.json.encode(whole) + b"\n\n" if text else b""  # no text: nothing to say
    assert framer.chunk(index, piece, None, [], []) == expected
