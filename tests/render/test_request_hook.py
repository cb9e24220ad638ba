"""--request-hook in the render worker: it sees the rendered request (prompt ids, sampling parameters, who
asked) before the engine; what it changes is what the engine gets, its refusal is the client's 400, and its
failure that request's 500 (the worker goes on)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.base import hooks
from sluice.base.config import ServerConfig
from sluice.ipc.messages import EngineRequest, Frame, RenderJob, bytes_to_ids
from sluice.render.worker import RenderWorker, build_core

EXAMPLE = str(Path(__file__).resolve().parents[2] / "deploy" / "hooks_example.py")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    return build_core(ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=256, postproc_workers=1))


def job(endpoint: str = "chat", **fields) -> RenderJob:
    body = {"model": "m", "max_tokens": 50, **fields}
    if endpoint == "chat":
        body["messages"] = HI
    elif endpoint == "messages":
        body["messages"] = HI
    return RenderJob("r1", endpoint, json.dumps(body).encode(), "ipc://x", 0.0)


def test_the_hook_sees_the_rendered_request_and_its_changes_reach_the_engine(core):
    seen = []

    def hook(r):
        seen.append(r)
        return {"temperature": 0.25, "max_tokens": 7}

    plain = RenderWorker(core, None, 30).render(job(user="ann"))
    hooked = RenderWorker(core, None, 30, hook).render(job(user="ann"))
    assert isinstance(plain, EngineRequest) and isinstance(hooked, EngineRequest)
    (r,) = seen
    assert (r.request_id, r.endpoint, r.model, r.user, r.max_model_len) == ("r1", "chat", "m", "ann", 256)
    assert r.prompt_token_ids == bytes_to_ids(plain.prompt_token_ids).tolist() and r.sampling == plain.sampling
    assert (hooked.sampling.temperature, hooked.sampling.max_tokens) == (0.25, 7)
    assert hooked.sampling.stop_token_ids == plain.sampling.stop_token_ids  # the rest as rendered


def test_a_refusal_is_a_400_and_the_example_caps_an_anthropic_trial_user(core):
    worker = RenderWorker(core, None, 30, hooks.load(f"{EXAMPLE}:cap_sampling", "--request-hook"))
    refused = worker.render(job(temperature=1.8))
    assert isinstance(refused, Frame) and refused.error is not None and refused.done
    assert (refused.error.status, refused.error.message) == (400, "temperature 1.8 is above this server's limit of 1.5")
    capped = worker.render(job("messages", metadata={"user_id": "trial"}))
    assert isinstance(capped, EngineRequest) and capped.sampling.max_tokens == 4
    assert isinstance(free := worker.render(job("messages")), EngineRequest) and free.sampling.max_tokens == 50


def test_a_hook_that_fails_gets_its_request_a_500_and_the_worker_goes_on(core, caplog):
    calls = []

    def flaky(r):
        calls.append(r)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return {"max_tokens": 10_000}  # past the context: the hook's fault too

    worker = RenderWorker(core, None, 30, flaky)
    for _ in range(2):
        failed = worker.render(job())
        assert isinstance(failed, Frame) and failed.error is not None and failed.error.status == 500
    assert "RuntimeError: boom" in caplog.text and "max_tokens 10000 not in" in caplog.text
    assert isinstance(RenderWorker(core, None, 30, lambda r: None).render(job()), EngineRequest)
