"""Chat's `prediction` in render: its text goes to the engine as the token ids the output would hold."""
from __future__ import annotations

import json

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import PostprocSpec, RenderJob, bytes_to_ids
from sluice.render.worker import build_core


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=64)
    return build_core(cfg)


def render(core, **body):
    return core.render(RenderJob("req-1", "chat", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode(), "ipc://reply", 1000.0))


def test_a_prediction_goes_to_the_engine_as_the_ids_of_its_text(core):
    text = "The quick brown fox jumps over the lazy dog."
    ids = core.bundle.tokenizer.encode(text, add_special_tokens=False).ids
    for content in (text, [{"type": "text", "text": "The quick brown "}, {"type": "text", "text": "fox jumps over the "
                                                                                                  "lazy dog."}]):
        req = render(core, prediction={"type": "content", "content": content})
        assert bytes_to_ids(req.prediction).tolist() == ids
        assert msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec).prediction


def test_no_prediction_sends_none_and_an_empty_one_no_ids(core):
    req = render(core)
    assert req.prediction == b"" and not msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec).prediction
    empty = render(core, prediction={"type": "content", "content": ""})
    assert empty.prediction == b"" and msgspec.msgpack.decode(empty.postproc_spec, type=PostprocSpec).prediction
