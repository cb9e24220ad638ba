"""Structured output: what a request constrains (a JSON schema, a regex, a choice, a grammar, the model's
tool-call format) compiled to a grammar engine's grammar.

Compiled in the render pool, in a child process of the render worker with a time and a memory limit (a
hostile schema can take minutes and gigabytes), and shipped to the engine, which applies it as a token
bitmask (engine/grammar.py). Two engines, chosen by --grammar-backend (bench/RESULTS.md#grammar-engines compares them):
llguidance (the default: it compiles lazily, and refuses what it cannot enforce) and xgrammar.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import resource
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from sluice.base.grammar_errors import DEAD_END, unsatisfiable
from sluice.render import deadline
from sluice.render.errors import RequestError
from sluice.schemas.openai import ResponseFormat

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sluice.render")
_START_TIMEOUT_S = 120.0  # loading the tokenizer for a 200k vocabulary takes seconds
_PROBE_STEPS = 64  # runs of forced tokens followed from a grammar's start before it is taken as able to go on
Backend = Literal["llguidance", "xgrammar"]
Kind = Literal["json_schema", "regex", "choice", "grammar", "lark"]
NO_WHITESPACE = {"whitespace_flexible": False}  # compact JSON, as OpenAI's strict mode writes it
_WHAT: dict[Kind, str] = {"json_schema": "the JSON schema", "regex": "the regex", "choice": "the choice",
                          "grammar": "the grammar", "lark": "the tool-call grammar (from the tools' schemas)"}


@dataclass(frozen=True)
class Constraint:
    """What an output must match, as the request (or the serving extension) says it."""

    kind: Kind  # json_schema: `source` is the schema's JSON; regex; choice: a JSON list of strings;
    #             grammar: EBNF (GBNF) or Lark, as a client sends it; lark: a Lark grammar of Sluice's own
    source: str
    param: str  # the request field it comes from, for the errors


def json_schema(schema: Any, param: str) -> Constraint:
    try:
        return Constraint("json_schema", json.dumps(schema, sort_keys=True), param)
    except RecursionError:
        raise RequestError(400, f"{param}: the JSON schema is nested too deeply", param=param) from None


def response_format(fmt: ResponseFormat) -> Constraint | None:
    """A response_format's constraint (None for plain text)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":  # an object (OpenAI), not any JSON value
        return json_schema({"type": "object"}, "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise RequestError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return json_schema(fmt.json_schema.schema, "response_format")


@dataclass(frozen=True)
class GrammarLimits:
    compile_timeout: float = 10.0  # seconds for one constraint: past it, 408
    memory: int = 4 << 30  # bytes the compiling process may grow by: past it, 400
    max_grammar_bytes: int = 64 << 20  # a compiled grammar larger than this is refused (400): the engine loads it
    cache_bytes: int = 256 << 20  # compiled grammars kept for constraints that come again


class GrammarCompiler:
    def __init__(self, model_path: str, vocab_size: int, limits: GrammarLimits = GrammarLimits(),
                 backend: Backend = "llguidance") -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self.limits = limits
        self.backend = backend
        # Started when the first constrained request arrives (that request waits for it, as in vLLM), so a
        # server that never sees one spends nothing on a grammar engine.
        self._worker: _CompileWorker | None = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_bytes = 0

    def compile(self, constraint: Constraint | ResponseFormat) -> str:
        """The grammar for a constraint, in the backend's form ("" for a plain-text response_format)."""
        if isinstance(constraint, ResponseFormat):
            if (c := response_format(constraint)) is None:
                return ""
            constraint = c
        if constraint.kind == "lark" and self.backend != "llguidance":
            raise RequestError(400, f"{constraint.param} needs --grammar-backend llguidance (this server runs "
                               f"{self.backend})", param=constraint.param)
        key = (constraint.kind, constraint.source)
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return hit
        grammar = self._compile(constraint)
        self._remember(key, grammar)
        return grammar

    def _compile(self, c: Constraint) -> str:
        if self._worker is None or not self._worker.alive:
            with deadline.excused():
                self._worker = _CompileWorker(self.backend, self._model_path, self._vocab_size, self.limits.memory)
        kind, value = self._worker.compile(c.kind, c.source, self.limits.compile_timeout)
        what = _WHAT[c.kind]
        if kind == "timeout":
            self._worker = None
            raise RequestError(408, f"{c.param}: compiling {what} took longer than {self.limits.compile_timeout:g}s;"
                               " simplify it", param=c.param, code="grammar_compile_timeout")
        if kind == "memory":
            self._worker = None
            raise RequestError(400, f"{c.param}: {what} is too complex (compiling it needed more than "
                               f"{self.limits.memory >> 20} MiB); simplify it", param=c.param,
                               code="grammar_too_complex")
        if kind == "error":  # both engines report a bad, unsupported or unsatisfiable constraint this way
            raise RequestError(400, unsatisfiable(c.param, value, what), param=c.param)
        if len(value) > self.limits.max_grammar_bytes:
            raise RequestError(400, f"{c.param}: {what} is too complex (its grammar takes {len(value) >> 20} MiB, "
                               f"more than {self.limits.max_grammar_bytes >> 20}); simplify it", param=c.param,
                               code="grammar_too_complex")
        return value

    def _remember(self, key: tuple[str, str], grammar: str) -> None:
        self._cache[key] = grammar
        self._cache_bytes += len(key[1]) + len(grammar)
        while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
            (_, old_source), old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old_source) + len(old)


class _CompileWorker:
    """xgrammar in a child process of the render worker: a compile that runs past its time is killed with
    the process, one that grows past its memory fails there, and neither touches the render worker."""

    def __init__(self, backend: Backend, model_path: str, vocab_size: int, memory: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="sluice-grammar", daemon=True,
                                 args=(child, backend, model_path, vocab_size, memory, mp.current_process().pid))
        self._proc.start()
        child.close()
        if not self._conn.poll(_START_TIMEOUT_S) or self._recv()[0] != "ready":
            self.kill()
            raise RequestError(500, "structured output could not start", code="internal_error")

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def compile(self, kind: Kind, source: str, timeout: float) -> tuple[str, str]:
        """("ok", grammar) | ("error", why) | ("memory", "") | ("timeout", "")."""
        self._conn.send((kind, source))
        if not self._conn.poll(timeout):
            log.warning("a %s compile took longer than %gs: stopping it", kind, timeout)
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


def _serve(conn: Connection, backend: Backend, model_path: str, vocab_size: int, memory: int, parent: int) -> None:
    from sluice.base import procs

    procs.die_with_parent(parent)
    procs.set_title("sluice: grammar compiler")
    compile_ = _llguidance(model_path, vocab_size) if backend == "llguidance" else _xgrammar(model_path, vocab_size)
    _limit_growth(memory)
    conn.send(("ready", ""))
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:  # the render worker is gone
            return
        try:
            reply = ("ok", compile_(kind, source))
        except MemoryError:
            reply = ("memory", "")
        except Exception as e:  # noqa: BLE001  (a bad constraint: every kind goes back to the client)
            reply = ("memory", "") if "bad_alloc" in str(e) else ("error", str(e))
        conn.send(reply)


def _llguidance(model_path: str, vocab_size: int):
    """kind, source -> an llguidance grammar, checked against the vocabulary (ValueError if it cannot be)."""
    import llguidance

    from sluice.base.checkpoint import guidance_tokenizer

    tokenizer = guidance_tokenizer(model_path, vocab_size)

    def compile_(kind: Kind, source: str) -> str:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=cast(Any, NO_WHITESPACE))
        else:  # (grammar: GBNF or Lark, whichever the text is)
            grammar = llguidance.grammar_from(cast(Any, kind), source)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer) or \
            _dead_start(llguidance.LLMatcher(tokenizer, grammar, log_level=0))
        if error:
            raise ValueError(error)
        return grammar

    return compile_


def _dead_start(matcher) -> str:
    """The error a grammar meets on the path its start forces ("" if none). llguidance compiles lazily, so a
    constraint that admits no output ($ref loops, `[^\\s\\S]`, `root ::= root`), or whose forced output never
    ends (a schema that must contain itself), passes validation and fails only at a mask: here, not in the
    engine. A dead end past a free choice still fails there (a clean 400 too: engine/grammar.py)."""
    for _ in range(_PROBE_STEPS):
        forced = matcher.compute_ff_tokens()
        taken = matcher.try_consume_tokens(forced) if forced and not matcher.is_error() else 0
        if matcher.is_error():
            return matcher.get_error()
        if not taken:  # nothing forced (or not as the tokenizer spells it): may anything come next?
            matcher.compute_bitmask()
            return matcher.get_error() if matcher.is_error() else ""
    return ""


def _xgrammar(model_path: str, vocab_size: int):
    """kind, source -> a serialized xgrammar grammar."""
    import xgrammar as xgr

    from sluice.base.checkpoint import tokenizer_info

    info = tokenizer_info(model_path, vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def build(kind: Kind, source: str):
        if kind == "json_schema":
            return compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "choice":
            return compiler.compile_regex("|".join(_regex_literal(c) for c in json.loads(source)))
        return compiler.compile_grammar(source)  # EBNF (a Lark grammar fails here: 400)

    def compile_(kind: Kind, source: str) -> str:
        compiled = build(kind, source)
        if not _opens(xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size)):
            raise ValueError(DEAD_END)
        return compiled.serialize_json()

    return compile_


def _opens(matcher, bitmask: torch.Tensor) -> bool:
    """Whether an xgrammar grammar allows a token at each step of the path its start forces (xgrammar compiles
    `[^\\s\\S]` or `root ::= root` without a word, and its first mask is empty)."""
    for _ in range(_PROBE_STEPS):
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].numpy().view(np.uint32)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        if len(allowed) == 0:
            return matcher.is_terminated()
        if len(allowed) > 1 or not matcher.accept_token(int(allowed[0])) or matcher.is_terminated():
            return True
    return True


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text)


def _limit_growth(memory: int) -> None:
    """Caps this process's address space at what it maps now plus `memory`."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + memory
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # a lower hard limit already applies
        pass
