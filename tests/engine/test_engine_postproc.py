"""The engine and the postproc shards wired together without processes: the messages that cross between
them are the real ones (Engine.accept, step_outputs, Shard.on_steps), only the sockets are missing."""
from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sluice.base.config import ServerConfig
from sluice.engine.engine import Engine
from sluice.engine.outputs import step_outputs
from sluice.ipc.addresses import shard_of
from sluice.ipc.messages import Abort, EndChoices, EngineRequest, Frame, PostprocSpec, SamplingParams, ids_to_bytes
from sluice.postproc.worker import Shard

SHARDS = 2
REPLY_TO = "ipc://ingress"
_examples = itertools.count()  # request ids are unique in a server's life (an early abort is remembered)


def make_engine(model_dir, tmp_path, runner: str, **kw) -> Engine:
    """A small engine in process (`kw`: more ServerConfig fields, or others than these defaults)."""
    cfg = ServerConfig(**{**dict(model="m", model_path=str(model_dir), served_model_names=["m"],
                                 runtime_dir=str(tmp_path), max_model_len=128, runner=runner, postproc_workers=SHARDS,
                                 max_num_seqs=16, max_num_batched_tokens=256), **kw})
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(tiny_chat_dir, tmp_path_factory):
    # 10 blocks of 16 tokens: a few requests fill it, so preemption happens too
    return make_engine(tiny_chat_dir, tmp_path_factory.mktemp("engine"), "model", num_kv_blocks=10)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))


def request(rid: str, prompt: list[int], *, n=1, stop=(), stream=False, endpoint="completions", **sampling):
    spec = PostprocSpec(request_id=rid, endpoint=endpoint, model="m", created=0, reply_to=REPLY_TO, stream=stream,
                        stop=list(stop), n=n)
    return EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(**sampling), shard_of(rid, SHARDS),
                         msgspec.msgpack.encode(spec), n=n)


class Pair:
    """An engine and its postproc shards, stepped together; frames collected per request."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.shards = [Shard(tokenizer) for _ in range(SHARDS)]
        self.frames: dict[str, list[Frame]] = defaultdict(list)
        self.to_engine: list = []

    def step(self, inputs=()) -> None:
        for msg in [*inputs, *self.to_engine]:
            self.engine.accept(msg)
        self.to_engine = []
        self.engine.admit_held()
        result, samples = self.engine.step()
        for k, msg in step_outputs(result, samples, self.engine.take_ended()).items():
            frames, to_engine = self.shards[k].on_steps([msg])
            self.to_engine += to_engine
            for frame in frames.get(REPLY_TO, []):
                self.frames[frame.request_id].append(frame)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
            if self.engine.held:
                time.sleep(0.01)
        raise AssertionError("the pair did not go idle")

    @property
    def idle(self) -> bool:
        return not (len(self.engine.scheduler) or self.engine.held or self.to_engine
                    or any(s.requests for s in self.shards))

    def finals(self, rid: str) -> list[Frame]:
        return [f for f in self.frames[rid] if f.done]

    def assert_empty(self) -> None:
        sched = self.engine.scheduler
        assert len(sched) == 0 and not sched.running and not sched.waiting
        assert sched.bm.num_used == 0, f"{sched.bm.num_used} KV blocks still held"
        assert all(not s.requests for s in self.shards)


@pytest.mark.parametrize("stream", [False, True])
def test_n3_with_a_stop_string_finishes(engine, tokenizer, stream):
    """The adversarial run's hang: n=3, temperature 0.8 and a stop string. One choice meeting the stop
    string must not end (or orphan) the request: all three choices end, one final frame comes."""
    pair = Pair(engine, tokenizer)
    probe = Pair(engine, tokenizer)
    probe.step([request("probe", [5, 6, 7], max_tokens=40, temperature=0.8, seed=1)])
    probe.run()
    text = json.loads(probe.finals("probe")[0].data)["choices"][0]["text"]
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip())
    pair.step([request("r", [5, 6, 7], n=3, stop=[stop], stream=stream, max_tokens=40, temperature=0.8, seed=1)])
    pair.run()
    (final,) = pair.finals("r")
    assert final.error is None
    if not stream:
        choices = json.loads(final.data)["choices"]
        assert len(choices) == 3 and choices[0]["finish_reason"] == "stop" and stop not in choices[0]["text"]
    pair.assert_empty()


def test_end_choices_frees_one_choice_and_the_others_go_on(engine, tokenizer):
    pair = Pair(engine, tokenizer)
    pair.step([request("r", [5, 6, 7], n=2, max_tokens=30, temperature=1.0, seed=3)])
    used = engine.scheduler.bm.num_used
    pair.engine.accept(EndChoices([("r", 0), ("unknown", 0)]))
    assert [s.index for s in engine.scheduler._by_id["r"]] == [1] and engine.scheduler.bm.num_used < used
    assert "unknown" not in engine._early_aborts  # a choice's end is not remembered as an early abort
    pair.step()
    assert "r" in pair.shards[shard_of("r", SHARDS)].requests  # postproc still waits for choice 0's end
    pair.step([Abort(["r"])])
    pair.assert_empty()


def test_an_abort_frees_the_request_and_its_shard_forgets_it(engine, tokenizer):
    pair = Pair(engine, tokenizer)
    pair.step([request("r", [5, 6, 7], n=2, max_tokens=50, stream=True)])
    pair.step()
    shard = pair.shards[shard_of("r", SHARDS)]
    assert "r" in shard.requests
    pair.step([Abort(["r"])])
    assert "r" not in shard.requests and pair.finals("r") == []
    pair.assert_empty()


def test_an_abort_that_overtakes_its_request_drops_it(engine, tokenizer):
    pair = Pair(engine, tokenizer)
    pair.step([Abort(["early"])])
    pair.step([request("early", [5, 6, 7], max_tokens=5)])
    pair.run()
    assert pair.frames["early"] == []
    pair.assert_empty()


def test_a_grammar_that_finishes_ends_the_output_despite_min_tokens_and_ignore_eos(engine, tokenizer, tiny_chat_dir):
    """{"const": 1} completes after one token or two: with min_tokens 20 the old engine asked the finished
    grammar for a mask and died; with ignore_eos (no stop ids) xgrammar refused to build the matcher."""
    from sluice.render.structured import GrammarCompiler
    from sluice.schemas.openai import JsonSchemaFormat, ResponseFormat

    grammar = GrammarCompiler(str(tiny_chat_dir), 704).compile(
        ResponseFormat("json_schema", JsonSchemaFormat(schema={"const": 1})))
    pair = Pair(engine, tokenizer)
    reqs = [request("min", [5, 6], max_tokens=40, min_tokens=20, stop_token_ids=(2,)),
            request("no-eos", [5, 6], max_tokens=40)]
    pair.step([msgspec.structs.replace(r, grammar=grammar) for r in reqs])
    pair.run()
    for rid in ("min", "no-eos"):
        (final,) = pair.finals(rid)
        choice = json.loads(final.data)["choices"][0]
        assert final.error is None and choice["text"] == "1" and choice["finish_reason"] == "stop", choice
    pair.assert_empty()


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(engine, tokenizer, monkeypatch):
    pair = Pair(engine, tokenizer)
    pair.step([request("a", [5, 6, 7], max_tokens=8), request("b", [8, 9], max_tokens=8)])
    real = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    pair.step()
    monkeypatch.setattr(engine.runner, "run", real)
    for rid in ("a", "b"):
        (final,) = pair.finals(rid)
        assert final.error is not None and final.error.status == 500
    pair.step([request("c", [5, 6, 7], max_tokens=4)])
    pair.run()
    assert pair.finals("c")[0].error is None
    pair.assert_empty()


def test_a_step_that_keeps_raising_takes_the_engine_down(engine, tokenizer, monkeypatch):
    pair = Pair(engine, tokenizer)
    monkeypatch.setattr(engine.runner, "run", lambda batch: (_ for _ in ()).throw(RuntimeError("broken")))
    with pytest.raises(RuntimeError, match="broken"):
        for i in range(5):
            pair.step([request(f"r{i}", [5, 6, 7], max_tokens=4)])
    monkeypatch.undo()
    engine._failed_steps = 0
    pair.run()
    pair.assert_empty()


@st.composite
def workloads(draw):
    """Requests arriving over the first steps, some aborted (client gone) at a later step."""
    reqs, example = [], next(_examples)
    for i in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 4))
        sampling = dict(max_tokens=draw(st.integers(1, 40)), temperature=draw(st.sampled_from([0.0, 0.8, 1.0])),
                        seed=draw(st.integers(0, 2**32)), min_tokens=draw(st.integers(0, 3)),
                        stop_token_ids=tuple(draw(st.lists(st.integers(0, 703), max_size=2))))
        prompt = draw(st.lists(st.integers(3, 700), min_size=1, max_size=60))
        stop = draw(st.lists(st.sampled_from(["e", "th", " a", "s ", "zz"]), max_size=2))
        arrive = draw(st.integers(0, 6))
        abort = draw(st.none() | st.integers(arrive, arrive + 30))
        reqs.append((arrive, abort, request(f"q{example}-{i}", prompt, n=n, stop=stop, stream=draw(st.booleans()),
                                            **sampling)))
    return reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_request_ends_once_and_the_cache_empties(engine, tokenizer, workload):
    """Random mixes of n, stop strings, stop ids, max_tokens, min_tokens and client aborts through the real
    engine (tiny model, a KV cache small enough to preempt) and postproc: every request the client still
    waits for gets exactly one final frame, an aborted one at most one, and afterwards no KV block, no
    sequence and no postproc state is left."""
    pair = Pair(engine, tokenizer)
    gone = set()
    for t in range(3000):
        inputs = [r for arrive, _, r in workload if arrive == t]
        aborts = [r.request_id for _, abort, r in workload if abort == t]
        gone.update(aborts)
        pair.step(inputs + ([Abort(aborts)] if aborts else []))
        if t > 40 and pair.idle:
            break
    else:
        raise AssertionError("requests never finished")
    for _, _, r in workload:
        finals = pair.finals(r.request_id)
        assert len(finals) <= 1 if r.request_id in gone else len(finals) == 1, (r.request_id, finals)
        assert all(f.error is None for f in finals)
    pair.assert_empty()


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["tags"]},
    {"enum": ["red", "green", "blue"]},
    {"type": "object"},
]


@pytest.fixture(scope="module")
def grammars(tiny_chat_dir):
    from sluice.render.structured import GrammarCompiler
    from sluice.schemas.openai import JsonSchemaFormat, ResponseFormat

    compiler = GrammarCompiler(str(tiny_chat_dir), 704)
    return [compiler.compile(ResponseFormat("json_schema", JsonSchemaFormat(schema=s))) for s in SCHEMAS]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_constrained_output_that_stops_always_parses_whatever_the_sampling(engine, tokenizer, grammars, data):
    """Every sampling option beside a JSON-schema grammar, batched with unconstrained requests: a choice
    that ends with "stop" is valid JSON that the schema accepts, and no request fails."""
    import jsonschema

    pair = Pair(engine, tokenizer)
    example, reqs = next(_examples), []
    for i in range(data.draw(st.integers(1, 4))):
        which = data.draw(st.integers(0, len(SCHEMAS)))  # len: no constraint
        sampling = dict(
            max_tokens=data.draw(st.integers(1, 60)), temperature=data.draw(st.sampled_from([0.0, 0.7, 1.0, 1.8])),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.3])), top_k=data.draw(st.sampled_from([0, 1, 5, 50])),
            min_p=data.draw(st.sampled_from([0.0, 0.1])), seed=data.draw(st.integers(0, 2**32)),
            min_tokens=data.draw(st.sampled_from([0, 5, 30])),
            stop_token_ids=data.draw(st.sampled_from([(2,), (), (2, 17)])),  # (): ignore_eos
            presence_penalty=data.draw(st.sampled_from([0.0, 1.5, -2.0])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.3])),
            logit_bias=data.draw(st.sampled_from([{}, {17: 100.0}, {2: -100.0}])),
            bad_words_ids=data.draw(st.sampled_from([[], [[17]], [[5, 6]]])))
        r = request(f"g{example}-{i}", [5, 6, 7], n=data.draw(st.integers(1, 3)), **sampling)
        reqs.append((which, msgspec.structs.replace(r, grammar=grammars[which]) if which < len(SCHEMAS) else r))
    pair.step([r for _, r in reqs])
    pair.run()
    for which, r in reqs:
        (final,) = pair.finals(r.request_id)
        assert final.error is None, final.error
        for choice in json.loads(final.data)["choices"]:
            if which < len(SCHEMAS) and choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(choice["text"]), SCHEMAS[which])
    pair.assert_empty()
