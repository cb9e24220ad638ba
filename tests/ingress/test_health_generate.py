"""/health_generate's probe: one token of a one-token prompt; on gpt-oss through harmony, one token of a chat
message, rendered by harmony and read by harmony's postproc, so that a fault in either fails the check."""
from __future__ import annotations

import msgspec
import pytest
from tokenizers import Tokenizer

from sluice.app.builtin_models import ensure_builtin
from sluice.base.config import ServerConfig
from sluice.ingress.app import health_job
from sluice.ipc.messages import Finished, PostprocSpec, Started, StepOutputs, bytes_to_ids, ids_to_bytes
from sluice.postproc import harmony
from sluice.postproc.worker import Shard
from sluice.render.worker import build_core


@pytest.fixture(scope="module")
def gpt_oss_dir():
    return ensure_builtin("tiny-gpt-oss")


def core_of(path, **options):
    return build_core(ServerConfig(model="m", model_path=str(path), served_model_names=["m"], runtime_dir="/tmp/x",
                                   max_model_len=4096, postproc_workers=1, **options))


def one_token(shard: Shard, request) -> list:
    """The probe's frames once the engine gives its one token."""
    started = Started(request.request_id, request.postproc_spec, num_prompt_tokens=3)
    out, _ = shard.on_steps([StepOutputs([started], [request.request_id], ids_to_bytes([0]), ids_to_bytes([200005]),
                                         [Finished(request.request_id, 0, "length")])])
    return out["ipc://x"]


def test_elsewhere_the_probe_is_one_token_of_a_one_token_prompt(tiny_chat_dir):
    request = core_of(tiny_chat_dir).render(health_job("h1", "m", False, "ipc://x"))
    assert bytes_to_ids(request.prompt_token_ids).tolist() == [0] and request.sampling.max_tokens == 1


def test_on_gpt_oss_the_probe_goes_through_harmony_and_a_fault_there_fails_it(gpt_oss_dir, monkeypatch):
    request = core_of(gpt_oss_dir).render(health_job("h1", "m", True, "ipc://x"))
    spec = msgspec.msgpack.decode(request.postproc_spec, type=PostprocSpec)
    assert (spec.endpoint, spec.output_mode, request.sampling.max_tokens) == ("chat", "tokens", 1)
    tokenizer = Tokenizer.from_file(str(gpt_oss_dir / "tokenizer.json"))
    prompt = tokenizer.decode(bytes_to_ids(request.prompt_token_ids).tolist(), skip_special_tokens=False)
    assert prompt.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    (frame,) = one_token(Shard(tokenizer), request)
    assert frame.done and frame.error is None

    def broken(self, token):
        raise IndexError("a harmony bug")

    monkeypatch.setattr(harmony.HarmonyParser, "feed", broken)
    (frame,) = one_token(Shard(tokenizer), request)
    assert frame.done and frame.error is not None and frame.error.status == 500
