"""--chat-template: a file, or a name in the checkpoint's list of named templates, in place of its own."""
from __future__ import annotations

import json
import shutil

import pytest

from sluice.app.cli import config_from_args, parse_args
from sluice.base.config import ServerConfig
from sluice.ipc.messages import RenderJob, bytes_to_ids
from sluice.render.tokenizer import chat_template, load_tokenizer
from sluice.render.worker import build_core

PLAIN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def named(tiny_chat_dir, tmp_path_factory):
    """tiny-chat with its template as tokenizer_config.json's list: a default and a tool_use one."""
    path = tmp_path_factory.mktemp("named") / "m"
    shutil.copytree(tiny_chat_dir, path)
    own = chat_template(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": own}, {"name": "tool_use", "template": PLAIN}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def _prompt_text(path, choice: str | None) -> str:
    cfg = ServerConfig(model="m", model_path=str(path), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=256, chat_template=choice)
    core = build_core(cfg)
    job = RenderJob("r", "chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
                    "ipc://x", 1.0)
    return core.bundle.tokenizer.decode(bytes_to_ids(core.render(job).prompt_token_ids).tolist(),
                                        skip_special_tokens=False)


def test_a_named_template_or_a_file_replaces_the_checkpoints_own(named, tmp_path):
    assert "<|im_start|>user" in _prompt_text(named, None)  # (the list's "default")
    assert _prompt_text(named, "tool_use") == "[user] Hi\n[assistant] "
    (tmp_path / "t.jinja").write_text(PLAIN.replace("[assistant]", "[bot]"))
    assert _prompt_text(named, str(tmp_path / "t.jinja")) == "[user] Hi\n[bot] "
    assert load_tokenizer(named, "tool_use").chat_template == PLAIN


def test_a_template_that_is_neither_is_refused_at_start_naming_what_there_is(named):
    with pytest.raises(ValueError, match="--chat-template nope: .*it names default, tool_use"):
        chat_template(named, "nope")
    with pytest.raises(ValueError, match="--chat-template /no/such.jinja"):
        config_from_args(parse_args(["serve", "--chat-template", "/no/such.jinja"]))
