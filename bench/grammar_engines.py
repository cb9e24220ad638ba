"""xgrammar against llguidance, the two grammar engines a server can constrain decoding with, on this machine:
the time to set up a vocabulary, to compile a schema (to its first token mask), the cost of one step's masks
at batch 1 / 16 / 64, and which JSON Schema features each enforces (compiles, and every sampled output of a
random walk through its masks validates), relaxes (compiles, but lets invalid output through) or rejects.

    python -m bench.grammar_engines [--model builtin:tiny-gpt-oss] [--coverage-model builtin:tiny-chat]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from bench.grammar_limits import wide_any_of
from sluice.app.builtin_models import resolve_model
from sluice.base.checkpoint import eos_token_ids, tokenizer_info

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (in the stub only: a TypedDict)

    from sluice.render.structured import Backend

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
ORDER = {"type": "object", "required": ["id", "items", "customer"], "properties": {
    "id": {"type": "integer", "minimum": 1},
    "customer": {"type": "object", "required": ["name", "email"], "properties": {
        "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}}}},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
SCHEMAS = {"weather tool": WEATHER, "nested order": ORDER, "anyOf 10x20": wide_any_of(10, 20),
           "anyOf 20x30": wide_any_of(20, 30)}

# (feature, schema): each is enforced when every sampled output validates against the schema.
FEATURES: list[tuple[str, dict]] = [
    ("type/properties/required", WEATHER),
    ("enum", {"enum": ["a", "b", 3]}),
    ("const", {"const": {"x": 1}}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 10}, {"type": "integer", "maximum": 2}]}),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}),
    ("$ref / $defs", {"$defs": {"p": {"type": "integer", "minimum": 0}}, "type": "array",
                      "items": {"$ref": "#/$defs/p"}, "maxItems": 4}),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "maxItems": 2,
                                                                               "items": {"$ref": "#/$defs/n"}}}}},
                        "$ref": "#/$defs/n"}),
    ("string minLength/maxLength", {"type": "string", "minLength": 3, "maxLength": 5}),
    ("string pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}),
    ("format date-time", {"type": "string", "format": "date-time"}),
    ("format uuid", {"type": "string", "format": "uuid"}),
    ("integer minimum/maximum", {"type": "integer", "minimum": -5, "maximum": 5}),
    ("exclusiveMinimum/Maximum", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("multipleOf", {"type": "integer", "multipleOf": 7}),
    ("array minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3}),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "maxItems": 3}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"},
                                     "maxProperties": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False, "maxProperties": 2}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"}, "maxProperties": 2}),
    ("minProperties/maxProperties", {"type": "object", "minProperties": 1, "maxProperties": 2}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}),
    ("if/then/else", {"type": "object", "properties": {"k": {"enum": ["n", "s"]}, "v": {}}, "required": ["k", "v"],
                      "if": {"properties": {"k": {"const": "n"}}}, "then": {"properties": {"v": {"type": "integer"}}},
                      "else": {"properties": {"v": {"type": "string"}}}}),
    ("not", {"type": "integer", "not": {"const": 3}, "minimum": 0, "maximum": 5}),
]


@dataclass
class Engine:
    """One engine behind the same four verbs: compile a schema, start a matcher, fill a batch's masks, accept."""

    name: str
    setup_s: float
    compile: Callable[[str], Any]
    matcher: Callable[[Any], Any]
    fill: Callable[[list[Any], torch.Tensor], None]  # masks of every matcher into the bitmask's rows
    accept: Callable[[Any, int], bool]
    done: Callable[[Any], bool]


def xgrammar_engine(path: Path, vocab: int) -> Engine:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = tokenizer_info(str(path), vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    stops = eos_token_ids(path)

    def fill(matchers: list, bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    return Engine("xgrammar", setup, lambda s: compiler.compile_json_schema(s, any_whitespace=False),
                  lambda g: xgr.GrammarMatcher(g, override_stop_tokens=stops), fill,
                  lambda m, t: m.accept_token(t), lambda m: m.is_terminated())


def llguidance_engine(path: Path, vocab: int) -> Engine:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=vocab,
                                       eos_token=eos_token_ids(path))
    executor = llguidance.LLExecutor()
    setup = time.perf_counter() - t0
    options: JsonCompileOptions = {"whitespace_flexible": False}

    def compile_(schema: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def fill(matchers: list, bitmask: torch.Tensor) -> None:
        lt.fill_next_token_bitmask_par(executor, [(m, row) for row, m in enumerate(matchers)], bitmask)

    return Engine("llguidance", setup, compile_, lambda g: llguidance.LLMatcher(tokenizer, g), fill,
                  lambda m, t: m.consume_token(t), lambda m: m.is_stopped())


def allowed(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(engine: Engine, grammar, vocab: int, rng: random.Random, max_steps: int = 400) -> list[int] | None:
    """A random output the grammar allows (None if it did not end within max_steps). Stop tokens, when
    allowed, are taken at once, so walks end."""
    m = engine.matcher(grammar)
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    out: list[int] = []
    stops = set(engine_stops(engine))
    for _ in range(max_steps):
        engine.fill([m], bitmask)
        ok = allowed(bitmask[0], vocab)
        if len(ok) == 0:
            return None
        ends = [t for t in ok if t in stops]
        token = ends[0] if ends and rng.random() < 0.6 else int(ok[rng.randrange(len(ok))])
        if not engine.accept(m, token):
            return None
        if token in stops:
            return out
        out.append(token)
        if engine.done(m):  # (llguidance stops on the text that completes the grammar)
            return out
    return None


_STOPS: dict[str, list[int]] = {}


def engine_stops(engine: Engine) -> list[int]:
    return _STOPS[engine.name]


def step_costs(engine: Engine, grammar, vocab: int, batch: int, steps: int = 40) -> float:
    """Median ms of one step's masks for `batch` matchers (each walks its own random output)."""
    rng = random.Random(0)
    matchers = [engine.matcher(grammar) for _ in range(batch)]
    bitmask = torch.zeros(batch, -(-vocab // 32), dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        for row, m in enumerate(matchers):
            ok = [t for t in allowed(bitmask[row], vocab) if t not in engine_stops(engine)]
            if ok:
                engine.accept(m, int(ok[rng.randrange(len(ok))]))
    return float(np.median(times) * 1000)


def coverage(engine: Engine, vocab: int, decode: Callable[[list[int]], str], samples: int) -> dict[str, str]:
    import jsonschema

    out = {}
    for feature, schema in FEATURES:
        try:
            grammar = engine.compile(json.dumps(schema))
        except Exception:  # noqa: BLE001 (either engine: refused)
            out[feature] = "rejected"
            continue
        rng, verdict, ended = random.Random(1), "enforced", 0
        for _ in range(samples):
            ids = walk(engine, grammar, vocab, rng)
            if ids is None:
                continue
            ended += 1
            try:
                jsonschema.validate(json.loads(decode(ids)), schema)
            except (ValueError, jsonschema.ValidationError):
                verdict = "relaxed"
                break
        out[feature] = verdict if ended else "no output ended"
    return out


def batch_cost(backend: Backend, temperature: float, dtype: torch.dtype, batch: int = 16,
               steps: int = 40, rounds: int = 3) -> tuple[float, float]:
    """Median over `rounds` (free and held interleaved) of the mean ms of a decode step of `batch` sequences
    on the o200k-vocabulary tiny Llama: all free, then one of them held to a schema (the engine's own
    runner, scheduler and grammar path)."""
    from bench.checkpoints import tiny_llama_o200k
    from bench.step_parts import _engine
    from sluice.engine.grammar import Grammars
    from sluice.engine.loader import load_model
    from sluice.engine.sequence import Sequence
    from sluice.ipc.messages import SamplingParams
    from sluice.render.structured import GrammarCompiler, json_schema

    path = tiny_llama_o200k()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    grammar = GrammarCompiler(str(path), vocab, backend=backend).compile(json_schema(WEATHER, "response_format"))
    grammars = Grammars(str(path), vocab, backend)
    loaded = grammars.load(grammar).result()
    weights = load_model(path, dtype, torch.device("cpu"))
    out: list[list[float]] = [[], []]
    for held in (0, 1) * rounds:
        runner, sched, rng = _engine(weights, dtype)
        for i in range(batch):
            seq = Sequence(f"r{i}", rng.integers(0, vocab - 1000, 64).tolist(),
                           SamplingParams(max_tokens=steps + 20, temperature=temperature, stop_token_ids=(2,)),
                           seed=i)
            if i < held:
                # (no stop ids: it runs to its length). The ignore: engine/sequence.py leaves `grammar` unannotated
                # (None), so mypy takes it for None only; it holds a GrammarState when the output is constrained.
                seq.grammar = grammars.state(loaded, [], [])  # type: ignore[assignment]
            sched.add(seq)
        for _ in range(5):
            b = sched.schedule()
            assert b is not None  # (max_tokens steps + 20: every sequence runs throughout)
            sched.update(b, runner.run(b).tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            b = sched.schedule()
            assert b is not None
            sched.update(b, runner.run(b).tokens)
        out[held].append((time.perf_counter() - t0) / steps * 1000)
    return statistics.median(out[0]), statistics.median(out[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-gpt-oss", help="for setup, compile and step costs")
    ap.add_argument("--coverage-model", default="builtin:tiny-chat", help="for feature coverage (random walks)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--batch-cost", action="store_true",
                    help="only: what one held sequence costs a batch of 16 (tiny Llama, o200k vocabulary)")
    args = ap.parse_args()
    if args.batch_cost:
        print("| engine | dtype | temperature | step ms, 16 free | 15 free + 1 held |")
        backends: tuple[Backend, ...] = ("llguidance", "xgrammar")
        for backend in backends:
            for dtype in (torch.float32, torch.bfloat16):
                for temperature in (0.0, 1.0):
                    free, held = batch_cost(backend, temperature, dtype)
                    print(f"| {backend} | {str(dtype)[6:]} | {temperature:g} | {free:.2f} | {held:.2f} |", flush=True)
        return
    from tokenizers import Tokenizer

    for label, model in (("timing", args.model), ("coverage", args.coverage_model)):
        path = resolve_model(model)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        engines = [xgrammar_engine(path, vocab), llguidance_engine(path, vocab)]
        for e in engines:
            _STOPS[e.name] = eos_token_ids(path)
        print(f"\n## {label}: {model} (vocabulary {vocab})")
        if label == "coverage":
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            results = {e.name: coverage(e, vocab, tok.decode, args.samples) for e in engines}
            print("| feature | " + " | ".join(results) + " |")
            for feature, _ in FEATURES:
                print(f"| {feature} | " + " | ".join(r[feature] for r in results.values()) + " |")
            for name, r in results.items():
                print(f"{name}: enforces {sum(v == 'enforced' for v in r.values())} of {len(FEATURES)}")
            continue
        for e in engines:
            print(f"{e.name}: vocabulary setup {e.setup_s:.2f} s")
        print("| schema | engine | compile to first mask (ms) | step masks ms, batch 1 / 16 / 64 |")
        for name, schema in SCHEMAS.items():
            for e in engines:
                t0 = time.perf_counter()
                try:
                    grammar = e.compile(json.dumps(schema))
                    m = e.matcher(grammar)
                    e.fill([m], torch.zeros(1, -(-vocab // 32), dtype=torch.int32))
                except Exception as err:  # noqa: BLE001
                    print(f"| {name} | {e.name} | failed: {str(err)[:60]} | |")
                    continue
                compiled = (time.perf_counter() - t0) * 1000
                costs = " / ".join(f"{step_costs(e, grammar, vocab, b):.2f}" for b in (1, 16, 64))
                print(f"| {name} | {e.name} | {compiled:.1f} | {costs} |", flush=True)


if __name__ == "__main__":
    main()
