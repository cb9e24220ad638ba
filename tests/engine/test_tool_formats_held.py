"""Every tool-call format held end to end (issue 33): the render stage's grammar for tool_choice "required"
(one call or several), a named function and strict tools, then the engine sampling tiny-chat's random weights
under it, then the postproc's parser and OpenAI framer, streamed and not. Whatever the model writes, the
client reads back exactly the calls the constraint demands: known functions (the named one), arguments that
fit their schemas, one call when parallel_tool_calls is false.

One checkpoint serves every format: tiny-chat with all the formats' markers added to its vocabulary (its
embedding grown by a few random rows), special tokens where they are in the families' own tokenizers
(Mistral's, DeepSeek's, Granite's, Llama's), so the markers must survive detokenization to be read."""
from __future__ import annotations

import copy
import itertools
import json

import jsonschema
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from sluice.base.config import ServerConfig
from sluice.render.extensions import extension_for, options_of
from sluice.render.tool_grammars import ALL_FORMATS
from sluice.render.worker import build_core
from tests.engine.test_engine_postproc import REPLY_TO, Pair, make_engine
from tests.render.test_tool_formats import DS, NAMED, read_answer, render

SPECIAL = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|tool_call|>", *DS]  # (special in their families)
VOCAB = 720  # tiny-chat's 704 rows and room for the markers
SCHEMAS = {  # (short strings: a call takes few tokens)
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                    "required": ["city", "days"], "additionalProperties": False},
    "get_time": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
                 "additionalProperties": False}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema, "strict": True}}
         for name, schema in SCHEMAS.items()]
MAX_TOKENS = {"qwen3_coder": 96}  # (its XML takes ~70 tokens a call in this vocabulary; the others' ~30)


@pytest.fixture(scope="module")
def checkpoint(tiny_chat_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("all-formats")
    for f in tiny_chat_dir.iterdir():
        if f.name not in ("tokenizer.json", "config.json", "model-00001-of-00002.safetensors"):
            (path / f.name).symlink_to(f)
    tokenizer = Tokenizer.from_file(str(tiny_chat_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((tiny_chat_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    weights = load_file(str(tiny_chat_dir / "model-00001-of-00002.safetensors"))
    embed = weights["model.embed_tokens.weight"]  # [V, D], tied to the LM head
    rows = torch.randn(VOCAB - len(embed), embed.shape[1], generator=torch.Generator().manual_seed(0)) * embed.std()
    weights["model.embed_tokens.weight"] = torch.cat([embed, rows])
    save_file(weights, str(path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def cores(checkpoint):
    """One render core per format, all on the checkpoint (and sharing its grammar compiler)."""
    cfg = ServerConfig(model="m", model_path=str(checkpoint), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=1024, postproc_workers=2, tool_parser="hermes")
    base = build_core(cfg)
    out = {}
    for name in ALL_FORMATS:
        core = out[name] = copy.copy(base)
        options = options_of(msgspec.structs.replace(cfg, tool_parser=name))
        core.ext = extension_for(cfg.hf_config(), base.bundle, options)
    return out


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    engine = make_engine(checkpoint, tmp_path_factory.mktemp("engine"), "model", max_model_len=1024,
                         max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=400)
    return Pair(engine, Tokenizer.from_file(str(checkpoint / "tokenizer.json")))


def _trigger(core, name: str) -> int:
    """The token that starts the format's calls (biased under strict tools, or the model would never call)."""
    ids = core.bundle.tokenizer.encode(ALL_FORMATS[name].trigger, add_special_tokens=False).ids
    return ids[0]


CASES = {
    "required": dict(tool_choice="required"),
    "required one": dict(tool_choice="required", parallel_tool_calls=False),
    "named": dict(tool_choice=NAMED),
    "strict": dict(parallel_tool_calls=False),  # (tool_choice auto: the model starts the call, biased to)
}


@pytest.fixture(scope="module")
def answers(cores, pair) -> dict[tuple[str, str, bool], tuple[list, str | None, str]]:
    """(format, case, stream) -> (calls, finish_reason, content) as a client reads them: every format's
    requests rendered, then run together through one engine and its postproc shards. A case's streamed and
    non-streamed requests share a seed (each case its own)."""
    runs = {}
    for seed, (name, case, stream) in enumerate(itertools.product(cores, CASES, (False, True))):
        core = cores[name]
        extra = dict(logit_bias={str(_trigger(core, name)): 100}) if case == "strict" else {}
        rid = f"{name}/{case}/{stream}"
        runs[name, case, stream] = rid, render(core, rid, REPLY_TO, **CASES[case], **extra, tools=TOOLS,
                                               stream=stream, seed=seed // 2, temperature=1.0,
                                               max_tokens=MAX_TOKENS.get(name, 48))
    pair.step([request for _, request in runs.values()])
    pair.run()
    pair.assert_empty()
    out = {}
    for key, (rid, _) in runs.items():
        (final,) = pair.finals(rid)
        assert final.error is None, (rid, final.error)
        out[key] = read_answer([f.data for f in pair.frames[rid]], stream=key[2])
    return out


@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_the_calls_read_back_are_those_the_tool_choice_demands_streamed_and_not(name, case, answers):
    streamed = answers[name, case, True]
    calls, finish, content = answers[name, case, False]
    assert streamed == (calls, finish, content)
    assert calls, (calls, finish, content)
    for fn, args in calls:
        assert fn in SCHEMAS and (case != "named" or fn == "get_time"), calls
        jsonschema.validate(args, SCHEMAS[fn])
    if case != "required":  # (parallel_tool_calls false, or a named function: one call)
        assert len(calls) == 1, calls
    if case != "strict":  # (the calls are the whole output, unless max_tokens cut a later call short)
        assert finish == "length" or (finish == "tool_calls" and not content.strip()), (calls, finish, content)
