"""response_format compiled in a child process under time, memory and size limits."""
from __future__ import annotations

import json
import re

import pytest

from sluice.render import tool_grammars
from sluice.render.errors import RequestError
from sluice.render.structured import Constraint, GrammarCompiler, GrammarLimits, json_schema
from sluice.schemas.openai import FunctionDef, JsonSchemaFormat, ResponseFormat, Tool


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
    assert gc.compile(wide_any_of(50, 50))  # (within its compile_timeout, 5 s: past it, a 408 is raised)


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


LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}  # a $ref that only refers to itself
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # must contain itself


def _tool(schema: dict) -> Tool:
    return Tool(function=FunctionDef(name="f", parameters=schema))


HERMES = tool_grammars.FORMATS["hermes"]


def _lit(text: str) -> str:
    """Call syntax as the serving extension writes it for tiny-chat: its call tags are tokens of their own."""
    tokens = {"<tool_call>": "<[699]>", "</tool_call>": "<[700]>"}
    return " ".join(tokens.get(p) or json.dumps(p) for p in re.split("(</?tool_call>)", text) if p)


IMPOSSIBLE = {  # what a client sent that no output can match, and the field it came in
    "response_format $ref loop": json_schema(LOOP, "response_format"),
    "response_format that must contain itself": json_schema(SELF, "response_format"),
    "regex [^\\s\\S]": Constraint("regex", r"[^\s\S]", "structured_outputs.regex"),
    "grammar root ::= root": Constraint("grammar", "root ::= root", "structured_outputs.grammar"),
    "named tool with a $ref loop": Constraint(
        "lark", tool_grammars.named(HERMES, _tool(LOOP), _lit), "tools"),
    "required tool with a $ref loop": Constraint(
        "lark", tool_grammars.required(HERMES, [_tool(LOOP)], _lit, True, None), "tools"),
}


@pytest.fixture(scope="module")
def guidance(tiny_chat_dir) -> GrammarCompiler:
    return compiler(tiny_chat_dir)


def assert_client_error(e: RequestError, param: str) -> None:
    """A 400 naming the field, in a few hundred characters, with none of the grammar engine's internals."""
    assert e.status == 400 and e.param == param, (e.status, e.param)
    assert str(e).startswith(param) and len(str(e)) < 300, str(e)
    assert not any(s in str(e) for s in ("<state>", "<grammar>", "Parser", "\n", ".cc:")), str(e)


@pytest.mark.parametrize("name", IMPOSSIBLE)
def test_a_constraint_no_output_can_match_is_a_short_400_naming_its_field(guidance, name):
    c = IMPOSSIBLE[name]
    with pytest.raises(RequestError) as e:
        guidance.compile(c)
    assert_client_error(e.value, c.param)


def test_xgrammar_refuses_what_admits_no_output_as_a_short_400_too(tiny_chat_dir):
    gc = compiler(tiny_chat_dir, "xgrammar")
    for name in ("response_format $ref loop", "regex [^\\s\\S]", "grammar root ::= root"):
        with pytest.raises(RequestError) as e:
            gc.compile(IMPOSSIBLE[name])
        assert_client_error(e.value, IMPOSSIBLE[name].param)


def test_the_forced_start_probe_passes_constraints_that_can_be_met(guidance):
    """A constraint forced to its end at once, one forced through a long literal, free text with strict tools,
    and forced text the tokenizer spells as a special token (which the grammar, taking text, refuses) compile."""
    for c in (json_schema({"const": 1}, "response_format"),
              Constraint("choice", '["only"]', "structured_outputs.choice"),
              Constraint("lark", tool_grammars.strict(HERMES, [_tool(LOOP)], _lit), "tools"),
              Constraint("lark", tool_grammars.required(HERMES, [_tool({"type": "object"})], _lit, True, None),
                         "tools"),
              Constraint("lark", tool_grammars.required(HERMES, [_tool({"type": "object"})], json.dumps, True, None),
                         "tools")):
        assert guidance.compile(c)
