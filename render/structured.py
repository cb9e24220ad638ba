"""Structured output: a request's response_format compiled to an xgrammar grammar.

Compiled in the render pool, in a child process of the render worker with a
time and a memory limit (a hostile schema can take minutes and gigabytes), and
shipped serialized to the engine, which applies it as a token bitmask
(engine/grammar.py).
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import resource
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ipc.openai import ResponseFormat
from render.errors import RequestError

log = logging.getLogger("sluice.render")
_START_TIMEOUT_S = 120.0  # loading the tokenizer info for a 200k vocabulary takes seconds


@dataclass(frozen=True)
class GrammarLimits:
    compile_timeout: float = 10.0  # seconds for one schema: past it, 408
    memory: int = 4 << 30  # bytes the compiling process may grow by: past it, 400
    max_grammar_bytes: int = 64 << 20  # a compiled grammar larger than this is refused (400): the engine loads it
    cache_bytes: int = 256 << 20  # compiled grammars kept for schemas that come again


class GrammarCompiler:
    def __init__(self, model_path: str, vocab_size: int, limits: GrammarLimits = GrammarLimits()) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self.limits = limits
        # Started when the first response_format arrives (that request waits for it, as in vLLM), so a
        # server that never sees one spends nothing on xgrammar.
        self._worker: _CompileWorker | None = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_bytes = 0

    def compile(self, fmt: ResponseFormat) -> str:
        """The serialized grammar for a response_format ("" for plain text)."""
        if fmt.type == "text":
            return ""
        schema: dict = {"type": "object"}  # json_object means an object (OpenAI), not any JSON value
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise RequestError(400, "response_format json_schema needs json_schema.schema",
                                   param="response_format")
            schema = fmt.json_schema.schema
        try:
            text = json.dumps(schema, sort_keys=True)
        except RecursionError:
            raise RequestError(400, "response_format: the JSON schema is nested too deeply",
                               param="response_format") from None
        if (hit := self._cache.get(text)) is not None:
            self._cache.move_to_end(text)
            return hit
        grammar = self._compile(text)
        self._remember(text, grammar)
        return grammar

    def _compile(self, schema: str) -> str:
        if self._worker is None or not self._worker.alive:
            self._worker = _CompileWorker(self._model_path, self._vocab_size, self.limits.memory)
        kind, value = self._worker.compile(schema, self.limits.compile_timeout)
        if kind == "timeout":
            self._worker = None
            raise RequestError(408, f"response_format: compiling the JSON schema took longer than "
                               f"{self.limits.compile_timeout:g}s; simplify it", param="response_format",
                               code="grammar_compile_timeout")
        if kind == "memory":
            self._worker = None
            raise RequestError(400, f"response_format: the JSON schema is too complex (compiling it needed more "
                               f"than {self.limits.memory >> 20} MiB); simplify it", param="response_format",
                               code="grammar_too_complex")
        if kind == "error":  # xgrammar reports a bad schema with several exception types
            raise RequestError(400, f"response_format: cannot compile the JSON schema: {value}",
                               param="response_format")
        if len(value) > self.limits.max_grammar_bytes:
            raise RequestError(400, f"response_format: the JSON schema is too complex (its grammar takes "
                               f"{len(value) >> 20} MiB, more than {self.limits.max_grammar_bytes >> 20}); simplify it",
                               param="response_format", code="grammar_too_complex")
        return value

    def _remember(self, schema: str, grammar: str) -> None:
        self._cache[schema] = grammar
        self._cache_bytes += len(schema) + len(grammar)
        while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
            old_schema, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old_schema) + len(old)


class _CompileWorker:
    """xgrammar in a child process of the render worker: a compile that runs past its time is killed with
    the process, one that grows past its memory fails there, and neither touches the render worker."""

    def __init__(self, model_path: str, vocab_size: int, memory: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model_path, vocab_size, memory, mp.current_process().pid),
                                 name="sluice-grammar", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(_START_TIMEOUT_S) or self._recv()[0] != "ready":
            self.kill()
            raise RequestError(500, "structured output could not start", code="internal_error")

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def compile(self, schema: str, timeout: float) -> tuple[str, str]:
        """("ok", grammar) | ("error", why) | ("memory", "") | ("timeout", "")."""
        self._conn.send(schema)
        if not self._conn.poll(timeout):
            log.warning("a JSON schema compile took longer than %gs: stopping it", timeout)
            self.kill()
            return "timeout", ""
        return self._recv()

    def _recv(self) -> tuple[str, str]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the process died: the kernel's (or the limit's) out-of-memory kill
            self.kill()
            return "memory", ""

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join()
        self._conn.close()


def _serve(conn: Connection, model_path: str, vocab_size: int, memory: int, parent: int) -> None:
    from sluice import procs

    procs.die_with_parent(parent)
    procs.set_title("sluice: grammar compiler")
    import xgrammar as xgr

    from sluice.checkpoint import tokenizer_info

    compiler = xgr.GrammarCompiler(tokenizer_info(model_path, vocab_size), cache_enabled=False)
    _limit_growth(memory)
    conn.send(("ready", ""))
    while True:
        try:
            schema = conn.recv()
        except EOFError:  # the render worker is gone
            return
        try:
            reply = ("ok", compiler.compile_json_schema(schema, any_whitespace=False).serialize_json())
        except MemoryError:
            reply = ("memory", "")
        except Exception as e:  # noqa: BLE001  (a bad schema: every kind goes back to the client)
            reply = ("memory", "") if "bad_alloc" in str(e) else ("error", str(e))
        conn.send(reply)


def _limit_growth(memory: int) -> None:
    """Caps this process's address space at what it maps now plus `memory`."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + memory
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # a lower hard limit already applies
        pass
