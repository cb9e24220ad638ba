"""--generation-config: the checkpoint's generation_config.json sampling values are every dialect's defaults (as
vLLM's --generation-config auto), a request's own values win, `none` keeps the API's own."""
from __future__ import annotations

import json
import shutil

import pytest

from sluice.base.checkpoint import sampling_defaults
from sluice.base.config import ServerConfig
from sluice.ipc.messages import RenderJob
from sluice.render.worker import build_core

QWEN3_STYLE = {"eos_token_id": [2], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
               "min_p": 0.05, "repetition_penalty": 1.1}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def checkpoint(tiny_chat_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-style") / "m"
    shutil.copytree(tiny_chat_dir, path)
    (path / "generation_config.json").write_text(json.dumps(QWEN3_STYLE))
    return path


def sampling(path, setting: str, endpoint: str, **body):
    cfg = ServerConfig(model="m", model_path=str(path), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=256, generation_config=setting)
    request = {"model": "m", "max_tokens": 4, **body}
    if endpoint == "responses":  # (its render job carries the request beside the stored conversation)
        request = {"request": {"model": "m", "max_output_tokens": 4, **body}}
    job = RenderJob("r", endpoint, json.dumps(request).encode(), "ipc://x", 1.0)
    return build_core(cfg).render(job).sampling


@pytest.mark.parametrize("endpoint, body", [("chat", {"messages": HI}), ("completions", {"prompt": "hi"}),
                                            ("messages", {"messages": HI}), ("responses", {"input": "hi"})])
def test_the_checkpoints_sampling_values_are_every_dialects_defaults(checkpoint, endpoint, body):
    s = sampling(checkpoint, "auto", endpoint, **body)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == pytest.approx((0.6, 0.95, 20, 0.05,
                                                                                             1.1))


def test_a_requests_own_values_win_and_none_keeps_the_apis_defaults(checkpoint):
    s = sampling(checkpoint, "auto", "chat", messages=HI, temperature=1.0, top_p=0.5, top_k=-1)
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((1.0, 0.5, 0, 0.05))
    s = sampling(checkpoint, "none", "chat", messages=HI)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_a_directory_of_defaults_is_read_and_one_without_them_refused(checkpoint, tiny_chat_dir, tmp_path):
    assert sampling_defaults(str(tiny_chat_dir), str(checkpoint))["temperature"] == 0.6
    assert sampling_defaults(str(tiny_chat_dir), "auto") == {}  # (its generation_config.json has stop ids alone)
    with pytest.raises(FileNotFoundError, match="--generation-config"):
        sampling_defaults(str(tiny_chat_dir), str(tmp_path))
