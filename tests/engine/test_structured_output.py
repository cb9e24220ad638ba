"""response_format grammars in the engine, and where gpt-oss applies them."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from sluice.app.builtin_models import ensure_builtin
from sluice.base.harmony_vocab import harmony_encoding
from sluice.engine.grammar import Grammars
from sluice.render.structured import GrammarCompiler
from sluice.schemas.openai import JsonSchemaFormat, ResponseFormat
from tests.engine.helpers import generate, make_engine, seq

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMAT = ResponseFormat("json_schema", JsonSchemaFormat(schema=SCHEMA))


def test_a_json_schema_constrains_the_whole_output(tiny_chat_dir):
    grammar = GrammarCompiler(str(tiny_chat_dir), 704).compile(FORMAT)
    runner, sched = make_engine(tiny_chat_dir)
    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    grammars = Grammars(str(tiny_chat_dir), 704)
    compiled = grammars.load(grammar).result()
    seqs = []
    for i in range(4):
        s = seq(f"r{i}", [5, 6, 7, 8 + i], max_tokens=60, temperature=1.0, seed=i, stop_token_ids=(eos,))
        s.grammar = grammars.state(compiled, [], [eos])
        seqs.append(s)
    out = generate(runner, sched, seqs)
    for ids in out.values():
        assert ids[-1] == eos
        value = json.loads(tok.decode(ids[:-1]))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


@pytest.fixture(scope="module")
def gpt_oss_dir():
    return ensure_builtin("tiny-gpt-oss")


def test_gpt_oss_constrains_only_the_final_channel(gpt_oss_dir):
    enc = harmony_encoding()
    trigger = enc.encode("<|channel|>final<|message|>", allowed_special="all")
    grammar = GrammarCompiler(str(gpt_oss_dir), 201088).compile(FORMAT)
    grammars = Grammars(str(gpt_oss_dir), 201088)
    compiled = grammars.load(grammar).result()
    runner, sched = make_engine(gpt_oss_dir, block_size=4)
    prompt = enc.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
    force_message = {200008: 100.0}  # the next token is <|message|>, which completes the header
    final = seq("final", prompt + trigger[:-1], max_tokens=40, logit_bias=force_message, stop_token_ids=(200002,))
    analysis = seq("analysis", prompt + enc.encode("<|channel|>analysis", allowed_special="all"), max_tokens=3,
                   logit_bias=force_message, stop_token_ids=(200002,))
    for s in (final, analysis):
        s.grammar = grammars.state(compiled, trigger, [200002])
    out = generate(runner, sched, [final, analysis])
    assert final.grammar.active and not analysis.grammar.active
    assert out["final"][0] == 200008 and out["final"][-1] == 200002
    value = json.loads(enc.decode(out["final"][1:-1]))
    assert set(value) == {"ok", "n"}
    assert out["analysis"] == [200008] * 3  # unconstrained: the bias alone decides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_held_greedy_row_takes_the_plain_argmax_where_its_grammar_allows_it(tiny_chat_dir, dtype):
    """Greedy rows held by a grammar ride the argmax path (no logits for the batch) and fall back to the
    masked logits where the grammar refuses the argmax: the same tokens as the masked path alone (asking for
    logprobs forces that path; it does not change the tokens)."""
    grammar = GrammarCompiler(str(tiny_chat_dir), 704).compile(FORMAT)
    grammars = Grammars(str(tiny_chat_dir), 704)
    compiled = grammars.load(grammar).result()
    tok = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    outputs = []
    for logprobs in (None, 0):
        runner, sched = make_engine(tiny_chat_dir, dtype=dtype)
        seqs = [seq(f"free{i}", [5, 6, 7, 9 + i], max_tokens=30, temperature=0.0) for i in range(5)]
        for i in range(3):
            s = seq(f"held{i}", [5, 6, 7, 20 + i], max_tokens=60, temperature=0.0, stop_token_ids=(eos,),
                    logprobs=logprobs)
            s.grammar = grammars.state(compiled, [], [eos])
            seqs.append(s)
        outputs.append(generate(runner, sched, seqs))
    fast, masked = outputs
    assert fast == masked
    for i in range(3):
        value = json.loads(tok.decode(fast[f"held{i}"][:-1]))
        assert set(value) == {"ok", "n"}
