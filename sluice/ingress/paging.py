"""Pages of stored lists in OpenAI's list shape (`object: list`, `data`, `first_id`, `last_id`, `has_more`),
by the query's `after`, `limit` and `order`: a response's input items, stored chat completions and their
messages."""
from __future__ import annotations

from typing import Any

import msgspec

from sluice.ingress.routes import Request
from sluice.ipc.messages import Failure

MAX_PAGE = 100
_json = msgspec.json.Encoder()


def page_query(request: Request, default_order: str) -> tuple[int, bool] | Failure:
    """The query's (limit, descending), or the 400 naming the one that is not one."""
    limit, order = request.integer("limit", 20, 1, MAX_PAGE), request.query.get("order", default_order)
    if limit is None:
        return Failure(400, f"limit is an integer from 1 to {MAX_PAGE}", param="limit")
    if order not in ("asc", "desc"):
        return Failure(400, "order is asc or desc", param="order")
    return limit, order == "desc"


def listed(data: list[dict[str, Any]], more: bool) -> bytes:
    return _json.encode({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


def item_page(items: list[dict[str, Any]], after: str | None, limit: int, descending: bool,
              what: str) -> bytes | Failure:
    """A page of `items` (each with an id, oldest first) past the one `after` names (a 400 when none does)."""
    if descending:
        items = items[::-1]
    start = 0
    if after:
        ids = [item["id"] for item in items]
        if after not in ids:
            return Failure(400, f"after: {after!r} names no {what}", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return listed(page, start + len(page) < len(items))
