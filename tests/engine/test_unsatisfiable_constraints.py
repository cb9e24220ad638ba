"""A request whose own constraints leave its output no way on, met only in the engine (past the render pool's
probe of a grammar's forced start): it ends alone with a short 400 that names its field, and the requests
beside it go on."""
from __future__ import annotations

import json

import llguidance
import msgspec
import pytest

from sluice.ipc.messages import Frame
from sluice.render.structured import NO_WHITESPACE, GrammarCompiler
from sluice.schemas.openai import JsonSchemaFormat, ResponseFormat
from tests.engine.test_engine_postproc import Pair, make_engine, request

EOS = 2
CHOICE = ResponseFormat("json_schema", JsonSchemaFormat(schema={"enum": ["yes", "no"]}))
# A schema that must contain itself: its forced output never ends (render refuses it at its start; here it is
# sent straight to the engine, as a dead end past a free choice would come)
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def engine(tiny_chat_dir, tmp_path_factory):
    return make_engine(tiny_chat_dir, tmp_path_factory.mktemp("engine"), "model", num_kv_blocks=64)


@pytest.fixture(scope="module")
def choice_grammar(tiny_chat_dir) -> str:
    return GrammarCompiler(str(tiny_chat_dir), 704).compile(CHOICE)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))


def constrained(rid: str, grammar: str, param: str, **sampling):
    r = request(rid, [5, 6, 7], max_tokens=20, stop_token_ids=(EOS,), **sampling)
    return msgspec.structs.replace(r, grammar=grammar, grammar_param=param)


def client_error(frame: Frame, param: str) -> str:
    """The frame's error, checked to be the client's (a 400 naming `param`) and short, with no parser state."""
    f = frame.error
    assert f is not None and f.status == 400 and f.param == param and f.code is None, f
    assert len(f.message) < 300 and f.message.startswith(param), f.message
    assert not any(s in f.message for s in ("<state>", "<grammar>", "Parser", "\n")), f.message
    return f.message


@pytest.mark.parametrize("field, sampling", [("allowed_token_ids", {"allowed_token_ids": [5, 6]}),
                                             ("bad_words", {"bad_words_ids": [[t] for t in range(704)]})])
def test_allowed_token_ids_or_bad_words_that_leave_no_token_the_grammar_allows_fail_the_request_alone(
        engine, tokenizer, choice_grammar, field, sampling):
    pair = Pair(engine, tokenizer)
    pair.step([constrained("starved", choice_grammar, "response_format", **sampling),
               constrained("fine", choice_grammar, "response_format"), request("free", [5, 6], max_tokens=6)])
    pair.run()
    (final,) = pair.finals("starved")
    assert f"{field} " in client_error(final, field) and "response_format" in final.error.message
    for rid in ("fine", "free"):
        (ok,) = pair.finals(rid)
        assert ok.error is None
    assert json.loads(json.loads(pair.finals("fine")[0].data)["choices"][0]["text"]) in ("yes", "no")
    pair.assert_empty()


@pytest.mark.parametrize("grammar", [
    llguidance.grammar_from("regex", r"[^\s\S]"),  # nothing may come at all
    llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SELF), defaults=NO_WHITESPACE),  # fails as it takes "{"
])
def test_a_grammar_that_goes_no_further_in_the_engine_is_a_400_naming_its_field(engine, tokenizer, grammar):
    pair = Pair(engine, tokenizer)
    pair.step([constrained("dead", grammar, "structured_outputs.regex"), request("free", [5, 6], max_tokens=6)])
    pair.run()
    (final,) = pair.finals("dead")
    client_error(final, "structured_outputs.regex")
    assert pair.finals("free")[0].error is None
    pair.assert_empty()


def test_an_engine_failure_stays_a_500(engine, tokenizer, choice_grammar, monkeypatch):
    """Only the request's own constraints make a 400: a sampled token the grammar refuses is the engine's."""
    from sluice.engine.grammar import _Guidance

    monkeypatch.setattr(_Guidance, "accept", lambda self, token: False)
    pair = Pair(engine, tokenizer)
    pair.step([constrained("r", choice_grammar, "response_format")])
    pair.run()
    (final,) = pair.finals("r")
    assert final.error.status == 500 and final.error.code == "internal_error"
    pair.assert_empty()
