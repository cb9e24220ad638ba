"""chat_template_kwargs (vLLM's) reach the chat template from every dialect; a model rendered without a chat
template (gpt-oss through harmony) refuses them rather than ignore them."""
from __future__ import annotations

import json

import pytest

from sluice.app.builtin_models import ensure_builtin
from sluice.base.config import ServerConfig
from sluice.ipc.messages import RenderJob, bytes_to_ids
from sluice.render.errors import RequestError
from sluice.render.tokenizer import chat_template
from sluice.render.worker import build_core

OFF = {"enable_thinking": False}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def core(tiny_chat_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("kwargs") / "t.jinja"  # tiny-chat's template, as Qwen3's reads the switch
    path.write_text("{% if enable_thinking is defined and not enable_thinking %}NO-THINKING {% endif %}"
                    + chat_template(tiny_chat_dir))
    return build_core(ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=256, chat_template=str(path)))


def _prompt(core, endpoint: str, **body) -> str:
    request = {"model": "m", **body}
    if endpoint == "responses":
        request = {"request": {"model": "m", **body}}
    ids = bytes_to_ids(core.render(RenderJob("r", endpoint, json.dumps(request).encode(), "ipc://x", 1.0))
                       .prompt_token_ids).tolist()
    return core.bundle.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("endpoint, body", [("chat", {"messages": HI}), ("messages", {"messages": HI, "max_tokens": 4}),
                                            ("responses", {"input": "Hi"})])
def test_every_dialect_hands_them_to_the_template(core, endpoint, body):
    assert _prompt(core, endpoint, **body, chat_template_kwargs=OFF).startswith("NO-THINKING ")
    assert "NO-THINKING" not in _prompt(core, endpoint, **body)


def test_gpt_oss_through_harmony_refuses_them_naming_the_field():
    core = build_core(ServerConfig(model="m", model_path=str(ensure_builtin("tiny-gpt-oss")), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=4096))
    job = RenderJob("r", "chat", json.dumps({"model": "m", "messages": HI, "chat_template_kwargs": OFF}).encode(),
                    "ipc://x", 1.0)
    with pytest.raises(RequestError) as e:
        core.render(job)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
