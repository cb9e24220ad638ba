"""Operators' hooks in the pipeline, each named `module:name` or `path/to/file.py:name` (a class is made once,
with no arguments, in each worker that calls it; a function is called as it is):

- `--request-hook`, in the render workers: sees each rendered request (its prompt ids and sampling parameters)
  before the engine does. It returns None (serve it as it is), or a mapping of the sampling parameters to
  change (REQUEST_HOOK_FIELDS), or raises Refused (a 400 in the request's dialect, with its message).
- `--post-processor-hook`, in the postproc workers: sees each choice's new text (an OutputChunk), after
  detokenizing and stop strings and before the reasoning and tool-call parsers, and returns emit(text) (this
  text instead), suppress() (nothing for this chunk) or terminate(reason) (the choice ends here, with finish
  reason "stop"). Its state, if any, is its own, keyed by request id (all of a request's chunks reach one
  postproc worker). It cannot apply where the output is read from token ids (gpt-oss through harmony).

A hook that raises (but for Refused), or gives what these rules do not allow, fails its request with a 500;
the worker and the other requests go on. deploy/hooks_example.py has an example of each.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import msgspec

from sluice.ipc.messages import SamplingParams

# The sampling parameters a request hook may change (the others hold token ids the render checked).
REQUEST_HOOK_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                       "presence_penalty", "frequency_penalty", "repetition_penalty")


class Refused(Exception):
    """Raised by a request hook: the request is answered 400 in its dialect's shape, with this message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class HookError(Exception):
    """A hook failed or broke its contract: its request gets a 500, its worker goes on."""


@dataclass(frozen=True)
class RenderedRequest:
    """What a request hook sees: a request as the engine will get it."""

    request_id: str
    endpoint: str  # chat, completions, messages (Anthropic), responses
    model: str  # as the client named it
    user: str | None  # the request's `user` (OpenAI), metadata.user_id (Anthropic)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_model_len: int  # the prompt and its output must fit in it


@dataclass(frozen=True)
class OutputChunk:
    """What a post-processor hook sees of one choice, each time it gets new text (and a last time at its end)."""

    request_id: str
    index: int  # the choice (n > 1)
    text_diff: str  # the new text (may be "": a token that shows none, or the end)
    text: str  # the choice's text so far as the model wrote it, text_diff included
    token_id: int  # the token that brought it
    is_final: bool  # the choice ends with this chunk


@dataclass(frozen=True)
class Emit:
    text: str


@dataclass(frozen=True)
class Suppress:
    pass


@dataclass(frozen=True)
class Terminate:
    reason: str


Verdict = Emit | Suppress | Terminate
RequestHook = Callable[[RenderedRequest], Mapping[str, Any] | None]
PostProcessorHook = Callable[[OutputChunk], Verdict]


def emit(text: str) -> Emit:
    """Send `text` for this chunk (the chunk's own text_diff: unchanged)."""
    return Emit(text)


def suppress() -> Suppress:
    """Send nothing for this chunk."""
    return Suppress()


def terminate(reason: str) -> Terminate:
    """End the choice here (finish reason "stop"), without this chunk; `reason` goes in the log."""
    return Terminate(reason)


def load(spec: str, flag: str) -> Callable[..., Any]:
    """The hook `spec` names, made (a class) or as it is (a function); ValueError, naming `flag`, when it
    names none."""
    hook = named(spec, flag)
    if isinstance(hook, type):
        try:
            hook = hook()
        except Exception as e:
            raise ValueError(f"{flag} {spec!r}: {spec.rpartition(':')[2]}() failed: {e}") from None
    if not callable(hook):
        raise ValueError(f"{flag} {spec!r}: {spec.rpartition(':')[0]} has no callable {spec.rpartition(':')[2]!r}")
    return hook


def named(spec: str, flag: str) -> Any:
    """What an operator's `module:name` or `path/to/file.py:name` names (a hook, a middleware factory);
    ValueError, naming `flag`, when it cannot be loaded."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag} {spec!r}: give module:name or path/to/file.py:name")
    try:
        module = _from_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise ValueError(f"{flag} {spec!r}: cannot load {where}: {e}") from None
    return getattr(module, name, None)


def _from_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"sluice_plugins.{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checked(spec: str, flag: str, load: Callable[[str, str], Any] = load) -> str:
    """`spec` once it loads (at startup: a typo fails the start, not each request or worker), a file's path
    absolute."""
    load(spec, flag)
    where, _, name = spec.rpartition(":")
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else spec


def hooked_sampling(hook: RequestHook, request: RenderedRequest) -> SamplingParams:
    """The request's sampling parameters once `hook` has seen it (Refused goes through: the client's 400)."""
    try:
        changes = hook(request)
    except Refused:
        raise
    except Exception as e:
        raise HookError(f"the request hook failed: {type(e).__name__}: {e}") from e
    if changes is None:
        return request.sampling
    if not isinstance(changes, Mapping):
        raise HookError(f"the request hook returned a {type(changes).__name__}; return None or a mapping of "
                        f"sampling parameters")
    if unknown := sorted(set(changes) - set(REQUEST_HOOK_FIELDS)):
        raise HookError(f"the request hook may change only {list(REQUEST_HOOK_FIELDS)}, not {unknown}")
    try:
        sampling = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(request.sampling, **changes)),
                                   SamplingParams)  # (the types checked)
    except msgspec.ValidationError as e:
        raise HookError(f"the request hook's sampling parameters: {e}") from None
    if problem := _out_of_bounds(sampling, request.max_model_len - len(request.prompt_token_ids)):
        raise HookError(f"the request hook's sampling parameters: {problem}")
    return sampling


def _out_of_bounds(s: SamplingParams, room: int) -> str | None:
    checks = ((1 <= s.max_tokens <= room, f"max_tokens {s.max_tokens} not in [1, {room}] (the context's room)"),
              (s.temperature >= 0, "temperature below 0"), (0 < s.top_p <= 1, "top_p not in (0, 1]"),
              (s.top_k >= 0, "top_k below 0"), (0 <= s.min_p <= 1, "min_p not in [0, 1]"),
              (0 <= s.min_tokens <= s.max_tokens, "min_tokens not in [0, max_tokens]"),
              (s.repetition_penalty > 0, "repetition_penalty not above 0"))
    return next((why for ok, why in checks if not ok), None)


def vetted(hook: PostProcessorHook, chunk: OutputChunk) -> Verdict:
    """`hook`'s verdict on `chunk` (HookError where it fails or gives none of the three)."""
    try:
        verdict = hook(chunk)
    except Exception as e:
        raise HookError(f"the post-processor hook failed: {type(e).__name__}: {e}") from e
    if not isinstance(verdict, (Emit, Suppress, Terminate)) or (isinstance(verdict, Emit) and
                                                               not isinstance(verdict.text, str)):
        raise HookError(f"the post-processor hook returned {verdict!r}; return emit(text), suppress() or "
                        f"terminate(reason)")
    return verdict
