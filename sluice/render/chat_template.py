"""Hugging Face chat templates, rendered in jinja2's sandbox, within a time and a size.

A template is code, and with --trust-request-chat-template it is the client's code: the sandbox keeps it
from the server's objects, and the limits here keep it from holding a render worker (its CPU, its memory).
"""
from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterator

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from sluice.render import deadline

RENDER_SECONDS = 5.0
# One `*` or `**` runs in C, where the time limit cannot stop it: bound what it may build.
MAX_INT_BITS = 4096
MAX_REPEAT = 1 << 20  # items in `sequence * n`


class ChatTemplateError(ValueError):
    """The template failed on this request (the message says why)."""


class TemplateTimeout(ChatTemplateError):
    pass


class TemplateOutputTooLong(ChatTemplateError):
    def __init__(self, chars: int) -> None:
        super().__init__(f"the rendered prompt passed {chars} characters")
        self.chars = chars


class _Expired(BaseException):
    """Raised by SIGALRM; a BaseException, so that no `except Exception` along the way swallows it."""


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if _too_big(operator, left, right):
            raise SecurityError(f"the result of {operator} would be too big")
        return super().call_binop(context, operator, left, right)


def _too_big(operator: str, left: Any, right: Any) -> bool:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**":
        return ints and right > 0 and abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS
    if ints:
        return left.bit_length() + right.bit_length() > MAX_INT_BITS
    return any(isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT
               for seq, n in ((left, right), (right, left)))


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # As transformers does: no HTML escaping, unicode kept.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(source: str, context: dict[str, Any], max_chars: int) -> str:
    """The template rendered with `context`. ChatTemplateError when it fails, runs past RENDER_SECONDS, or
    writes more than `max_chars` characters."""
    try:
        with _time_limit(RENDER_SECONDS):
            return _render(compile_template(source), context, max_chars)
    except _Expired:
        raise TemplateTimeout(f"the chat template took longer than {RENDER_SECONDS:g} s to render") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # run on this request's data, however the template fails, this request failed
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


def _render(template: Template, context: dict[str, Any], max_chars: int) -> str:
    pieces, size = [], 0
    for piece in template.generate(context):  # piece by piece, so a runaway output stops early
        size += len(piece)
        if size > max_chars:
            raise TemplateOutputTooLong(size)
        pieces.append(piece)
    return "".join(pieces)


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises _Expired where the code is when `seconds` pass. Signals reach the main thread only (where a
    render worker runs its requests); elsewhere there is no limit. A timer already set (pytest-timeout's)
    is set again after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Expired

    with deadline.shielded():  # (a render's deadline must not leave the alarm set, or the handler changed)
        previous = signal.signal(signal.SIGALRM, expire)
        outer, _ = signal.getitimer(signal.ITIMER_REAL)
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
        try:
            with deadline.interruptible():
                yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer:
                signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))
