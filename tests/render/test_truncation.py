"""Truncation 'auto' in one pass (issue 37): the turns that go are those that dropping one turn at a time
drops, found with a few renders however long the conversation."""
from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.base.config import ServerConfig
from sluice.ipc.messages import RenderJob, bytes_to_ids
from sluice.render import extensions
from sluice.render.errors import RequestError
from sluice.render.truncation import Turns, fewest_dropped, without_oldest_turn
from sluice.render.worker import build_core
from sluice.schemas.responses import CreateResponse, RenderBody

SEARCH = settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=60)


def _core(model_dir, max_model_len: int):
    return build_core(ServerConfig(model="m", model_path=str(model_dir), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=max_model_len, postproc_workers=1))


@pytest.fixture(scope="module")
def small(tiny_chat_dir):
    return _core(tiny_chat_dir, 256)


@pytest.fixture(scope="module")
def full(tiny_chat_dir):
    return _core(tiny_chat_dir, 2048)


def _job(items: list[dict], **fields) -> RenderJob:
    request = msgspec.convert({"model": "m", "input": items, "truncation": "auto", **fields}, CreateResponse)
    return RenderJob("resp_1", "responses", msgspec.json.encode(RenderBody(request)), "ipc://x", 0.0)


def _one_turn_at_a_time(core, job: RenderJob):
    """What truncation did before: render, and while the prompt does not fit, drop the oldest turn."""
    request, dialect, _ = core._translate(job)
    while True:
        try:
            return core._render(job, request, dialect)
        except RequestError as e:
            fewer = without_oldest_turn(request) if e.code == "context_length_exceeded" else None
            if fewer is None:
                raise
            request = fewer


def _outcome(fn):
    try:
        r = fn()
    except RequestError as e:
        return e.status, e.code, e.message
    return bytes_to_ids(r.prompt_token_ids).tolist(), r.sampling.max_tokens


@pytest.fixture
def renders(monkeypatch):
    """How many times the chat template renders."""
    calls = []
    real = extensions.render_chat
    monkeypatch.setattr(extensions, "render_chat", lambda *a: calls.append(1) or real(*a))
    return calls


def test_1600_items_truncate_in_a_few_renders_to_the_turns_that_fit(full, renders):
    items = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} words"} for i in range(1600)]
    job = _job(items, instructions="Count.", max_output_tokens=8)
    full._message_overhead  # (measured once per server, on a sample of its own)
    renders.clear()
    prompt = bytes_to_ids(full.render(job).prompt_token_ids).tolist()
    assert len(renders) <= 4, f"{len(renders)} renders"  # the whole, the guess, the turn next to it (+1 spare)
    # the turns kept are the newest that fit: one more does not
    request, dialect, _ = full._translate(job)
    turns = Turns.of(request)
    kept = next(k for k in range(len(turns)) if turns.keeping(k).messages[1].content in full._decode(prompt))
    assert 0 < len(prompt) <= 2048 - 8 and turns.keeping(kept).messages[0].content == "Count."
    with pytest.raises(RequestError, match="maximum context length"):
        full._render(job, turns.keeping(kept - 1), dialect)


def test_a_request_that_fits_renders_once(full, renders):
    full._message_overhead
    renders.clear()
    full.render(_job([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "bye"}]))
    assert len(renders) == 1


_TEXT = st.integers(0, 25).map(lambda n: " ".join(f"w{i}" for i in range(n)))
_ITEM = st.one_of(
    st.builds(lambda role, text: {"role": role, "content": text},
              st.sampled_from(["user", "user", "assistant", "system", "developer"]), _TEXT),
    st.builds(lambda i, args: {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": args},
              st.integers(0, 3), _TEXT.map(lambda t: '{"a": "%s"}' % t)),
)


@SEARCH
@given(items=st.lists(_ITEM, min_size=1, max_size=32), max_output=st.one_of(st.none(), st.integers(1, 60)))
def test_the_turns_kept_are_those_dropping_one_at_a_time_keeps(small, items, max_output):
    if not any(i.get("role") == "user" for i in items):
        items = [{"role": "user", "content": "go"}, *items]
    job = _job(items, max_output_tokens=max_output)
    assert _outcome(lambda: small.render(job)) == _outcome(lambda: _one_turn_at_a_time(small, job))


@SEARCH
@given(n=st.integers(2, 3000), data=st.data())
def test_the_search_finds_the_fewest_turns_to_drop(n, data):
    first_fit = data.draw(st.integers(1, n), label="first_fit")  # n: nothing fits, the last turn alone neither
    guess = data.draw(st.one_of(st.just(first_fit), st.integers(0, n)), label="guess")
    asked = []

    def fits(k: int) -> bool:
        assert 0 < k < n and k not in asked
        asked.append(k)
        return k >= first_fit

    assert fewest_dropped(n, guess, fits) == min(first_fit, n - 1)
    if first_fit == n:
        assert n - 1 in asked
    assert len(asked) <= (2 if guess == first_fit < n else 4 * math.ceil(math.log2(n)) + 2), asked
