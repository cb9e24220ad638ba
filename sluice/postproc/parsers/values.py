"""Argument values of the formats that do not write JSON: qwen3_coder's text parameters, pythonic's Python
literals (read with ast, never evaluated)."""
from __future__ import annotations

import ast
import json
from typing import Any


def typed_value(text: str, schema_type: str | None) -> Any:
    """A parameter's text as its JSON-schema type says (text that does not fit the type stays text)."""
    if schema_type in (None, "string"):
        return text
    if schema_type == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if text.strip().lower() in ("null", "none"):  # (of a type besides string: the schema's types include null)
        return None
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return text
    expected: dict[str, type | tuple[type, ...]] = {"integer": int, "number": (int, float), "object": dict,
                                                    "array": list}
    kind = expected.get(schema_type or "", object)
    if schema_type == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, kind) and not isinstance(value, bool) else text


_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)) and node.value is not ...:
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    raise ValueError("not a literal")


def _function_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _function_name(node.value) + "." + node.attr
    raise ValueError("not a function name")


def python_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a Python list of calls `[f(a=1), g()]` as (name, arguments JSON); None when the text is not
    (yet) Python; a ValueError when it is, but not a list of calls with keyword arguments and literal values."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    body = tree.body
    if not isinstance(body, ast.List) or not body.elts or not all(isinstance(e, ast.Call) for e in body.elts):
        raise ValueError("not a list of calls")
    calls = []
    for call in body.elts:
        assert isinstance(call, ast.Call)
        if call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("positional arguments")
        args = {k.arg: _literal(k.value) for k in call.keywords}
        calls.append((_function_name(call.func), json.dumps(args, ensure_ascii=False)))
    return calls
