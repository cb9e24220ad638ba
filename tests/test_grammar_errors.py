"""A grammar engine's error reaches a client as one short line that names the field, without the engine's
parser state or grammar."""
from __future__ import annotations

from sluice.base.grammar_errors import MAX_DETAIL, detail, nothing_allowed, unsatisfiable

LLGUIDANCE_DUMP = ("NoExtensionBias\n<state>\nTokens: ⟦⟧\n0 tokens, 0 bytes; grm_prefix: \"\"\nParser: {\n"
                   + '  "lexer_cost": 1436,\n' * 300 + "}\n</state><grammar>\nstart: %json {}\n</grammar>")
REGEX_ERROR = ('at 1(8): invalid regex "[a-" (in regex): regex parse error:\n    [a-\n    ^\n'
               'error: unclosed character class\n   1 | start: /[a-/\n              ^\n')
XGRAMMAR_ERROR = "[10:12:23] /project/cpp/json_schema_converter.cc:3562: Circular $ref chain with no schema content"


def test_a_multi_kb_parser_dump_becomes_one_short_line_that_names_the_field():
    message = unsatisfiable("response_format", LLGUIDANCE_DUMP, "the JSON schema")
    assert message.startswith("response_format: the JSON schema admits no output") and len(message) < 300
    assert "<state>" not in message and "lexer_cost" not in message and "\n" not in message


def test_the_engine_says_how_far_the_output_got():
    assert "after 7 output tokens" in unsatisfiable("tools", LLGUIDANCE_DUMP, after=7)
    assert "after 3 output tokens" in unsatisfiable("tools", "parser error: Too many items (limit 50000)", after=3)


def test_an_engine_error_keeps_its_words_but_not_its_source_excerpts_or_log_stamps():
    assert detail(REGEX_ERROR) == \
        'invalid regex "[a-" (in regex): regex parse error: [a- error: unclosed character class'
    assert detail(XGRAMMAR_ERROR) == "Circular $ref chain with no schema content"
    assert len(detail("x" * 10_000)) == MAX_DETAIL


def test_a_request_field_that_starves_the_grammar_is_named_with_the_grammars_field():
    message = nothing_allowed("bad_words", "structured_outputs.regex", 0)
    assert message.startswith("bad_words bans every token that structured_outputs.regex allows")
