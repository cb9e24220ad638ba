"""Hugging Face chat templates, rendered in jinja2's sandbox."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # As transformers does: no HTML escaping, unicode kept.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(source: str, **context) -> str:
    try:
        return compile_template(source).render(**context)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
