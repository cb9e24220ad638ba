"""Any JSON schema is either refused up front (a 400 naming the field) or held: every output that the
default grammar engine's masks let through, and that ends, validates against it. Outputs are random walks
through the masks (the engine's own matchers, render's own compiler), as a model with random logits takes."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sluice.engine.grammar import Grammars
from sluice.render.errors import RequestError
from sluice.render.structured import GrammarCompiler, json_schema

VOCAB = 704
EOS = 2

_leaf = st.one_of(
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 6)),
    st.just({"type": "string", "pattern": "^[a-c]{1,4}$"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "number", "minimum": 0, "maximum": 1}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(st.integers(-5, 5), st.sampled_from(["a", "b", "c"]), st.booleans()), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
    st.sampled_from([{"const": 1}, {"const": "x"}, {"const": [1, 2]}]),
)


def _containers(children):
    obj = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required, closed: {"type": "object", "properties": props, "required": required,
                                      "additionalProperties": not closed},
            st.lists(st.sampled_from(sorted(props)), unique=True), st.booleans()))
    arr = st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
                    children, st.integers(0, 2), st.integers(0, 2))
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda s: {"anyOf": s})
    return st.one_of(obj, arr, any_of)


schemas = st.recursive(_leaf, _containers, max_leaves=6)


@pytest.fixture(scope="module")
def engines(tiny_chat_dir):
    grammars = Grammars(str(tiny_chat_dir), VOCAB)
    tokenizer = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    return GrammarCompiler(str(tiny_chat_dir), VOCAB), grammars, tokenizer


def walk(grammars: Grammars, loaded, rng: random.Random, steps: int = 200) -> list[int] | None:
    state = grammars.state(loaded, [], [EOS])
    bitmask = torch.zeros(1, -(-VOCAB // 32), dtype=torch.int32)
    out: list[int] = []
    for _ in range(steps):
        state.fill(bitmask, 0)
        bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:VOCAB]
        allowed = bits.nonzero().flatten().tolist()
        assert allowed and state.error is None, state.error
        token = EOS if EOS in allowed and rng.random() < 0.6 else rng.choice(allowed)
        state.observe(out, token)
        assert state.error is None, state.error
        if token == EOS:
            return out
        out.append(token)
        if state.terminated:
            return out
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_a_schema_is_refused_or_every_ending_output_validates(engines, schema, seed):
    compiler, grammars, tokenizer = engines
    try:
        grammar = compiler.compile(json_schema(schema, "response_format"))
    except RequestError as e:  # refused up front, and it says where
        assert e.status == 400 and e.param == "response_format"
        return
    loaded = grammars.load(grammar).result()
    rng = random.Random(seed)
    for _ in range(4):
        ids = walk(grammars, loaded, rng)
        if ids is not None:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
