"""What a response_format schema costs to compile, and which limit refuses it: the render pool's compiler
(a child process with --grammar-compile-timeout / --grammar-memory / --grammar-max-bytes) on schemas that
grow fast: anyOf k objects of m required string properties.

    python -m bench.grammar_limits [--model builtin:tiny-gpt-oss] [--sizes 10x20,20x30,30x40,50x50]
"""
from __future__ import annotations

import argparse
import json
import time

from sluice.app.builtin_models import resolve_model
from sluice.render.errors import RequestError
from sluice.render.structured import GrammarCompiler, GrammarLimits
from sluice.schemas.openai import JsonSchemaFormat, ResponseFormat


def wide_any_of(k: int, m: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"p{i}_{j}": {"type": "string"} for j in range(m)},
                       "required": [f"p{i}_{j}" for j in range(m)]} for i in range(k)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny-gpt-oss")
    ap.add_argument("--sizes", default="10x20,20x30,30x40,50x50")
    args = ap.parse_args()
    path = resolve_model(args.model)
    compiler = GrammarCompiler(str(path), json.loads((path / "config.json").read_text())["vocab_size"],
                               GrammarLimits())
    t0 = time.perf_counter()
    compiler.compile(ResponseFormat("json_object"))
    print(f"first schema (starts the compiler): {time.perf_counter() - t0:.2f} s")
    for size in args.sizes.split(","):
        k, m = map(int, size.split("x"))
        schema = wide_any_of(k, m)
        t0 = time.perf_counter()
        try:
            grammar = compiler.compile(ResponseFormat("json_schema", JsonSchemaFormat(schema=schema)))
            outcome = f"{len(grammar) >> 20} MiB"
        except RequestError as e:
            outcome = f"{e.status}: {e.message}"
        print(f"{size} ({len(json.dumps(schema)) / 1000:.1f} KB): {time.perf_counter() - t0:.2f} s, {outcome}")


if __name__ == "__main__":
    main()
