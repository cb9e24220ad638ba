"""The Responses API's tools: functions, namespaces (groups of functions, offered to the model as their
functions), and the tools this server does not offer the model, under one policy (`left_out`)."""
from __future__ import annotations

from typing import Any

import msgspec

from sluice.schemas import sdk_fields


class ResponsesTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function, a namespace (a group of functions: `tools`), or a tool of a type this server does not offer
    the model (sdk_fields.RESPONSES_TOOLS says why of each type): kept as its type alone."""

    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ResponsesTool] | None = None  # a namespace's

    def __post_init__(self) -> None:
        if self.type in ("function", "namespace") and not self.name:
            raise ValueError(f"a {self.type} tool needs a name")
        if self.type == "namespace" and not self.tools:
            raise ValueError("a namespace tool needs tools (the functions it groups)")


def flat_name(namespace: str, name: str) -> str:
    """The name the model sees for a namespace's function: the two joined by `__`, or by nothing where one
    side brings its own underscore (Codex's MCP namespaces, `mcp__server__`, end in one)."""
    joint = "" if namespace.endswith("_") or name.startswith("_") else "__"
    return f"{namespace}{joint}{name}"


def functions(tools: list[ResponsesTool] | None) -> list[tuple[str | None, ResponsesTool]]:
    """The functions the model is offered, each with its namespace (None: a plain function tool)."""
    out: list[tuple[str | None, ResponsesTool]] = []
    for tool in tools or []:
        if tool.type == "function":
            out.append((None, tool))
        elif tool.type == "namespace":
            out.extend((tool.name, f) for f in tool.tools or [] if f.type == "function")
    return out


def left_out(tools: list[ResponsesTool] | None) -> list[tuple[str, str]]:
    """(param, type) of each tool this server does not offer the model. The one policy for them: left out of
    the prompt, each named in the response's `warnings` and in a log line; a 400 under --strict-tools."""
    out: list[tuple[str, str]] = []
    for i, tool in enumerate(tools or []):
        if tool.type == "namespace":
            out.extend((f"tools[{i}].tools[{j}]", f.type) for j, f in enumerate(tool.tools or [])
                       if f.type != "function")
        elif tool.type != "function":
            out.append((f"tools[{i}]", tool.type))
    return out


def left_out_message(param: str, tool_type: str) -> str:
    why = sdk_fields.RESPONSES_TOOLS.get(tool_type) or "a tool type this server does not know"
    return f"{param} (type {tool_type!r}) was left out of the prompt: {why}"


def check_names(tools: list[ResponsesTool] | None) -> None:
    """Two functions the model would know by one name are a 400 naming the second."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        group = [(f"tools[{i}].tools[{j}]", flat_name(tool.name, f.name)) for j, f in enumerate(tool.tools or [])
                 if f.type == "function"] if tool.type == "namespace" else \
            [(f"tools[{i}]", tool.name)] if tool.type == "function" else []
        for param, name in group:
            if name in seen:
                raise ValueError(f"{param}: the model would know two functions as {name!r} (a namespace's "
                                 f"function by its namespace and name joined) - at `$.{param}`")
            seen.add(name)
