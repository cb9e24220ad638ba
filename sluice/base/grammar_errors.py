"""What a client hears when its output constraint cannot be met: one short line that names the request field,
never a grammar engine's internals (an llguidance error carries its parser's state and the whole grammar: KBs).

Both places that meet such an error word it here: the render pool, when a constraint does not compile or its
forced start leads nowhere (render/structured.py), and the engine, when a grammar can go no further mid-output
or the request's allowed_token_ids / bad_words leave nothing it allows (engine/grammar.py). Either way it is
the client's constraint at fault: a 400, never a 500.
"""
from __future__ import annotations

import re

MAX_DETAIL = 200  # characters of an engine's own words kept (a message stays under a few hundred in all)
# llguidance's word for a grammar that allows no token next and has not ended (render's xgrammar probe says it too)
DEAD_END = "NoExtensionBias"
_ENDLESS = ("Too many items",)  # llguidance: following the grammar's forced tokens never ends
_INTERNALS = re.compile(r"<state>|<grammar>")
_EXCERPT = re.compile(r"^(\d+ \||\^)")  # a source excerpt of the engine's internal grammar, and its caret
# llguidance's place in its internal grammar; xgrammar's log stamp and C++ source line
_POSITION = re.compile(r"^(at \d+\(\d+\): |\[[\d:]+\] \S+:\d+: )")


def detail(raw: str) -> str:
    """A grammar engine's error as one line: no parser state, no grammar text, at most MAX_DETAIL characters."""
    text = _INTERNALS.split(raw, maxsplit=1)[0]
    lines = [line.strip() for line in text.splitlines()]
    line = _POSITION.sub("", " ".join(x for x in lines if x and not _EXCERPT.match(x)))
    return line if len(line) <= MAX_DETAIL else line[: MAX_DETAIL - 1] + "…"


def unsatisfiable(param: str, raw: str, what: str = "the constraint", after: int | None = None) -> str:
    """The message for `param`'s constraint that fails with the engine's error `raw` (after `after` output
    tokens, when it failed in the engine)."""
    where = "" if after is None else f" after {after} output tokens"
    if DEAD_END in raw:
        admits = "admits no output" if after is None else f"admits nothing more{where}"
        return (f"{param}: {what} {admits}: no text can match it (e.g. a $ref that only refers to itself, "
                "a regex or rule that matches nothing)")
    if any(s in raw for s in _ENDLESS):
        return (f"{param}: {what} cannot be enforced: its forced output{where} never ends (e.g. a schema "
                "that must contain itself)")
    return f"{param}: {what} cannot be enforced{where}: {detail(raw)}"


def nothing_allowed(field: str, param: str, after: int) -> str:
    """The message for a request whose `field` (allowed_token_ids, bad_words) rules out every token its
    constraint `param` allows next."""
    verb = "allows no token" if field == "allowed_token_ids" else "bans every token"
    return f"{field} {verb} that {param} allows after {after} output tokens: the output cannot go on"
