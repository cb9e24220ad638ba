"""What a request asks its output to match, as the core reads it from the request's fields (the serving
extension adds the tool-call grammars: render/tool_grammars.py)."""
from __future__ import annotations

import json

from sluice.render.errors import RequestError
from sluice.render.structured import Constraint, json_schema
from sluice.schemas.openai import ChatCompletionRequest, CompletionRequest, NamedToolChoice


def requested(request: ChatCompletionRequest | CompletionRequest) -> tuple[Constraint | None, bool]:
    """The client's structured_outputs, as a constraint (None without one); never the whole output on a
    model that reasons first (the serving extension says where the answer starts)."""
    so = request.structured_outputs
    if so is None:
        return None, False
    given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
             if getattr(so, name) not in (None, False)]
    if len(given) != 1:
        raise RequestError(400, f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                           f"got {given or 'none'}", param="structured_outputs")
    param = f"structured_outputs.{given[0]}"
    if so.json is not None:
        try:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        except ValueError:
            raise RequestError(400, "structured_outputs.json is not a JSON schema", param=param) from None
        return json_schema(schema, param), False
    if so.json_object:
        return json_schema({"type": "object"}, param), False
    if so.regex is not None:
        return Constraint("regex", so.regex, param), False
    if so.choice is not None:
        return Constraint("choice", json.dumps(so.choice), param), False
    return Constraint("grammar", so.grammar or "", param), False


def check_tool_choice(request: ChatCompletionRequest) -> None:
    """A forced call needs tools, and a named one a tool of that name."""
    choice = request.tool_choice
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return
    names = [t.function.name for t in request.tools or []]
    if not names:
        raise RequestError(400, "tool_choice forces a call, but the request has no tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(400, f"tool_choice names {choice.function.name!r}, which is not in tools {names}",
                           param="tool_choice")

