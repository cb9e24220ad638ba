"""response_format compiled in a child process under time, memory and size limits."""
from __future__ import annotations

import json
import time

import pytest

from ipc.openai import JsonSchemaFormat, ResponseFormat
from render.errors import RequestError
from render.structured import GrammarCompiler, GrammarLimits


def wide_any_of(k: int, m: int) -> ResponseFormat:
    """anyOf k objects of m required string properties: compiling it grows fast with k and m."""
    objs = [{"type": "object", "properties": {f"p{i}_{j}": {"type": "string"} for j in range(m)},
             "required": [f"p{i}_{j}" for j in range(m)]} for i in range(k)]
    return ResponseFormat("json_schema", JsonSchemaFormat(schema={"anyOf": objs}))


SMALL = ResponseFormat("json_schema",
                       JsonSchemaFormat(schema={"type": "object", "properties": {"a": {"type": "integer"}}}))


def compiler(tiny_chat_dir, backend="llguidance", **limits) -> GrammarCompiler:
    return GrammarCompiler(str(tiny_chat_dir), 704, GrammarLimits(**limits), backend)


def test_a_schema_compiles_once_and_comes_from_the_cache_after(tiny_chat_dir):
    gc = compiler(tiny_chat_dir)
    grammar = gc.compile(SMALL)
    assert json.loads(grammar)  # xgrammar's serialized form
    gc._worker.kill()  # a second compile would need it
    assert gc.compile(SMALL) == grammar


def test_the_cache_is_bounded_in_bytes_and_keeps_the_newest(tiny_chat_dir):
    gc = compiler(tiny_chat_dir)
    gc.compile(ResponseFormat("json_object"))
    gc.compile(SMALL)
    assert len(gc._cache) == 2
    gc.limits = GrammarLimits(cache_bytes=gc._cache_bytes - 1)
    gc.compile(ResponseFormat("json_schema", JsonSchemaFormat(schema={"type": "integer"})))
    keys = [source for _, source in gc._cache]
    assert keys[-1] == '{"type": "integer"}' and '{"type": "object"}' not in keys
    assert gc._cache_bytes == sum(len(k[1]) + len(v) for k, v in gc._cache.items())
    assert gc._cache_bytes <= gc.limits.cache_bytes or len(gc._cache) == 1


def test_llguidance_compiles_the_adversarial_schema_at_once_within_small_limits(tiny_chat_dir):
    """The schema that grew a render worker to 17 GB under xgrammar: llguidance builds its lexer as it goes."""
    gc = compiler(tiny_chat_dir, memory=512 << 20, compile_timeout=5, max_grammar_bytes=1 << 20)
    gc.compile(SMALL)
    t0 = time.perf_counter()
    assert gc.compile(wide_any_of(50, 50))
    assert time.perf_counter() - t0 < 5


def test_a_compile_past_its_time_is_a_408_and_the_next_one_works(tiny_chat_dir):
    gc = compiler(tiny_chat_dir, "xgrammar", compile_timeout=0.5)
    gc.compile(SMALL)
    with pytest.raises(RequestError) as e:
        gc.compile(wide_any_of(50, 50))
    assert e.value.status == 408 and e.value.param == "response_format"
    assert json.loads(gc.compile(ResponseFormat("json_object")))


def test_a_compile_past_its_memory_is_a_400(tiny_chat_dir):
    gc = compiler(tiny_chat_dir, "xgrammar", memory=256 << 20, compile_timeout=60)
    with pytest.raises(RequestError) as e:
        gc.compile(wide_any_of(30, 40))
    assert e.value.status == 400 and e.value.code == "grammar_too_complex"
    assert json.loads(gc.compile(SMALL))


def test_a_grammar_past_its_size_is_a_400(tiny_chat_dir):
    with pytest.raises(RequestError) as e:
        compiler(tiny_chat_dir, "xgrammar", max_grammar_bytes=1 << 20).compile(wide_any_of(10, 20))
    assert e.value.status == 400 and e.value.code == "grammar_too_complex"


def test_bad_and_deeply_nested_schemas_are_400s(tiny_chat_dir):
    gc = compiler(tiny_chat_dir)
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    for schema in ({"type": "no-such-type"}, deep):
        with pytest.raises(RequestError) as e:
            gc.compile(ResponseFormat("json_schema", JsonSchemaFormat(schema=schema)))
        assert e.value.status == 400 and e.value.param == "response_format"
