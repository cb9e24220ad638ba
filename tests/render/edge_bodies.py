"""Request bodies with one integer field set to a given value, for the edge tests (unit and end to end)."""
from __future__ import annotations

from typing import Iterator

import msgspec
from msgspec import inspect

# Integers each side of every width a value can be cut to on its way: int32 (token ids, counts), int64
# (msgpack, numpy), uint64, a float's mantissa, and far past all of them.
EDGES = [-1, 0, 1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30,
         -2**31, -2**63, -2**63 - 1, -10**30]

_SCALARS = ["top_k", "seed", "priority", "n", "min_tokens", "prompt_logprobs", "max_tokens"]
SCALARS = {"chat": _SCALARS + ["max_completion_tokens", "top_logprobs", "thinking_token_budget"],
           "completions": _SCALARS + ["logprobs", "best_of"]}
LISTS = {"chat": ["stop_token_ids", "allowed_token_ids", "prompt_token_ids"],
         "completions": ["stop_token_ids", "allowed_token_ids", "prompt"]}
FIELDS = {endpoint: SCALARS[endpoint] + LISTS[endpoint] + ["logit_bias"] for endpoint in SCALARS}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def body(endpoint: str, field: str, value: int, model: str = "m") -> dict:
    """A small request (two tokens out) with `field` set to `value`: as is, as a one-item list, or as a
    logit_bias key."""
    out: dict = {"model": model, "max_tokens": 2}
    out.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"})
    if field == "logit_bias":
        out["logit_bias"] = {str(value): 1.0}
    elif field in LISTS[endpoint]:
        out[field] = [value]
    else:
        out[field] = value
    if field == "top_logprobs":
        out["logprobs"] = True
    return out


def names(param: str | None, field: str) -> bool:
    """Whether an error's param is the field, or a part of it (`stop_token_ids[0]`)."""
    return param is not None and (param == field or param.startswith((field + "[", field + ".")))


def integer_types(t: inspect.Type, path: str = "") -> Iterator[tuple[str, inspect.IntType]]:
    """Every integer type within a request type, with its path (`stop_token_ids[]`, `tools[].function...`)."""
    if isinstance(t, inspect.IntType):
        yield path, t
    elif isinstance(t, inspect.UnionType):
        for member in t.types:
            yield from integer_types(member, path)
    elif isinstance(t, (inspect.ListType, inspect.SetType, inspect.FrozenSetType, inspect.VarTupleType)):
        yield from integer_types(t.item_type, path + "[]")
    elif isinstance(t, inspect.DictType):
        yield from integer_types(t.key_type, path + "{}")
        yield from integer_types(t.value_type, path + "{}")
    elif isinstance(t, inspect.StructType):
        for f in t.fields:
            yield from integer_types(f.type, f"{path}.{f.encode_name}" if path else f.encode_name)  # (as sent)
    elif isinstance(t, inspect.Metadata):
        yield from integer_types(t.type, path)


def request_integer_types(request_type: type[msgspec.Struct]) -> list[tuple[str, inspect.IntType]]:
    return list(integer_types(inspect.type_info(request_type)))
