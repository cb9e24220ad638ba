"""Structured output: a request's response_format compiled to an xgrammar grammar.

Compiled here, in the render pool, and shipped serialized to the engine, which
applies it as a token bitmask (engine/grammar.py).
"""
from __future__ import annotations

import json
from functools import lru_cache

from ipc.openai import ResponseFormat
from render.errors import RequestError
from sluice.checkpoint import Background, tokenizer_info


class GrammarCompiler:
    def __init__(self, model_path: str, vocab_size: int) -> None:
        def build():
            import xgrammar as xgr

            return xgr.GrammarCompiler(tokenizer_info(model_path, vocab_size))

        # Loaded when the first response_format arrives (that request waits for it, as in vLLM), so a
        # server that never sees one spends nothing on xgrammar.
        self._compiler = Background(build, lazy=True)

    def compile(self, fmt: ResponseFormat) -> str:
        """The serialized grammar for a response_format ("" for plain text)."""
        if fmt.type == "text":
            return ""
        if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema is None):
            raise RequestError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        # json_object means an object (OpenAI), not any JSON value
        schema = fmt.json_schema.schema if fmt.type == "json_schema" else {"type": "object"}
        return self._compile(json.dumps(schema, sort_keys=True))

    @lru_cache(maxsize=256)
    def _compile(self, schema: str) -> str:
        try:
            grammar = self._compiler.get().compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # xgrammar reports a bad schema with several exception types
            raise RequestError(400, f"response_format: cannot compile the JSON schema: {e}",
                               param="response_format") from None
        return grammar.serialize_json()
