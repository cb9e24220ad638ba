"""thinking_token_budget through the render and the engine on builtin:tiny-chat (greedy, so that the budgeted
output can be told against the free one): the reasoning runs for the budget's tokens, as the model writes
them, then </think> follows; a model that does not open a <think> block is left alone."""
from __future__ import annotations

import json

import pytest

from sluice.base.config import ServerConfig
from sluice.engine.grammar import Grammars
from sluice.ipc.messages import EngineRequest, RenderJob, bytes_to_ids
from sluice.render.errors import RequestError
from sluice.render.worker import build_core
from tests.engine.helpers import generate, make_engine, seq

BUDGET = 6
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


def rendered(tiny_chat_dir, parser: str | None, **body) -> EngineRequest:
    core = build_core(ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"],
                                   runtime_dir="/tmp/x", max_model_len=4096, postproc_workers=1,
                                   reasoning_parser=parser))
    job = RenderJob("r1", "chat", json.dumps({"model": "m", "messages": ASK, "max_tokens": 16, **body}).encode(),
                    "ipc://x", 0.0)
    return core.render(job)


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir)


def run(engine, tiny_chat_dir, request: EngineRequest) -> list[int]:
    runner, sched = engine
    s = seq("r", bytes_to_ids(request.prompt_token_ids).tolist(), max_tokens=16, temperature=0.0,
            stop_token_ids=request.sampling.stop_token_ids)
    if request.grammar:
        grammars = Grammars(str(tiny_chat_dir), 704)
        s.grammar = grammars.state(grammars.load(request.grammar).result(), request.grammar_trigger,
                                   list(request.sampling.stop_token_ids))
    return generate(runner, sched, [s])["r"]


def test_the_reasoning_ends_after_the_budget_with_the_models_end_of_thinking(engine, tiny_chat_dir):
    end = 698  # </think> in builtin:tiny-chat's vocabulary
    free = run(engine, tiny_chat_dir, rendered(tiny_chat_dir, "deepseek_r1"))
    held = run(engine, tiny_chat_dir, rendered(tiny_chat_dir, "deepseek_r1", thinking_token_budget=BUDGET))
    assert end not in free[:BUDGET + 1] and all(t > 2 for t in free[:BUDGET])  # (the model would go on, in text)
    assert held[:BUDGET] == free[:BUDGET] and held[BUDGET] == end


def test_a_model_that_does_not_open_its_thinking_is_left_alone(engine, tiny_chat_dir):
    request = rendered(tiny_chat_dir, "think", thinking_token_budget=BUDGET)
    assert "think[max_tokens=6]" in request.grammar
    assert run(engine, tiny_chat_dir, request) == run(engine, tiny_chat_dir, rendered(tiny_chat_dir, "think"))


def test_a_budget_is_refused_where_the_model_cannot_end_its_reasoning(tiny_chat_dir):
    with pytest.raises(RequestError, match="needs a model that reasons in a <think> block") as e:
        rendered(tiny_chat_dir, None, thinking_token_budget=BUDGET)
    assert (e.value.status, e.value.param) == (400, "thinking_token_budget")
