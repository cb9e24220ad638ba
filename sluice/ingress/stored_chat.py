"""Stored chat completions (`store: true` on a chat request): the ingress keeps each one as it answers it,
and serves OpenAI's routes over them: GET /v1/chat/completions (a page, by model and metadata),
GET / POST (metadata) / DELETE /v1/chat/completions/{id}, GET /v1/chat/completions/{id}/messages. What is
stored, and where: sluice/state/chat.py."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec

from sluice import state
from sluice.ingress.dialects import KEEPERS, OPENAI_CHAT, Dialect
from sluice.ingress.http import respond
from sluice.ingress.paging import item_page, listed, page_query
from sluice.ingress.routes import Request, route
from sluice.ipc.messages import Failure, Frame
from sluice.schemas.errors import OPENAI
from sluice.schemas.openai import ChatCompletionRequest, Metadata
from sluice.state.chat import ChatStore

_json = msgspec.json.Encoder()
_metadata = msgspec.json.Decoder(dict[str, str])


class _Update(msgspec.Struct, forbid_unknown_fields=True):
    metadata: Metadata | None


_UPDATE = Dialect("chat", "/v1/chat/completions/{id}", _Update, "", OPENAI)  # (how its body is read)


def _db(ingress) -> state.Database[ChatStore]:
    return state.database(ingress.cfg, ChatStore)


async def keeper(ingress, request: ChatCompletionRequest) -> Callable[[Frame], Awaitable[Failure | None]] | \
        Failure | None:
    """What stores a chat request's completion (None: it asked for none; a Failure: the database cannot take
    it, said before the work rather than after it)."""
    if not request.store:
        return None
    if isinstance(usable := await _db(ingress).answer(ChatStore.check), Failure):
        return usable
    metadata = _json.encode(request.metadata or {})

    async def keep(frame: Frame) -> Failure | None:
        if frame.error is not None:  # (a completion that failed is not stored)
            return None
        completion = frame.stored or frame.data  # (a stream's last frame carries the whole body)
        messages = _json.encode([_message(f"{frame.request_id}-{i}", m)
                                 for i, m in enumerate(msgspec.to_builtins(request.messages))])
        saved = await _db(ingress).answer(ChatStore.save, frame.request_id, request.model, metadata, completion,
                                          messages)
        return saved if isinstance(saved, Failure) else None
    return keep


KEEPERS["chat"] = keeper


def _message(mid: str, message: dict[str, Any]) -> dict[str, Any]:
    """A request message as .../messages lists it: with an id; a content of parts as its text, the parts
    beside it."""
    content = message.get("content")
    parts = None
    if isinstance(content, list):
        parts, content = content, "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "id": mid, "content": content, "content_parts": parts}


def _completion(row) -> dict[str, Any]:
    return {**msgspec.json.decode(row["completion"]), "metadata": _metadata.decode(row["metadata"])}


def _missing(cid: str) -> Failure:
    return Failure(404, f"no stored chat completion with id {cid!r}", "not_found")


async def _answer(ingress, send, cid: str, row) -> int:
    """A stored completion's row as the API answers it (or the error that took its place)."""
    if isinstance(row, Failure) or row is None:
        return await ingress.respond_failure(send, OPENAI_CHAT, row or _missing(cid))
    return await respond(send, 200, _json.encode(_completion(row)))


@route("GET", "/v1/chat/completions", dialect=OPENAI_CHAT)
async def list_completions(ingress, request: Request, receive, send) -> int:
    query = request.query
    if isinstance(paged := page_query(request, "asc"), Failure):
        return await ingress.respond_failure(send, OPENAI_CHAT, paged)
    metadata = {k[9:-1]: v for k, v in query.items() if k.startswith("metadata[") and k.endswith("]")}
    got = await _db(ingress).answer(ChatStore.page, *paged, query.get("after"), query.get("model"), metadata)
    if got is None:
        got = Failure(400, f"no stored chat completion {query.get('after')!r} to list after", param="after")
    if isinstance(got, Failure):
        return await ingress.respond_failure(send, OPENAI_CHAT, got)
    rows, more = got
    return await respond(send, 200, listed([_completion(row) for row in rows], more))


@route("GET", "/v1/chat/completions/{id}", dialect=OPENAI_CHAT)
async def retrieve(ingress, request: Request, receive, send) -> int:
    cid = request.params["id"]
    return await _answer(ingress, send, cid, await _db(ingress).answer(ChatStore.get, cid))


@route("POST", "/v1/chat/completions/{id}", dialect=OPENAI_CHAT)
async def update(ingress, request: Request, receive, send) -> int:
    """Sets a stored completion's metadata (the one thing the API lets a client change)."""
    cid = request.params["id"]
    got = await ingress.read_request(_UPDATE, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    metadata = _json.encode(got[0].metadata or {})
    return await _answer(ingress, send, cid, await _db(ingress).answer(ChatStore.update, cid, metadata))


@route("DELETE", "/v1/chat/completions/{id}", dialect=OPENAI_CHAT)
async def delete(ingress, request: Request, receive, send) -> int:
    cid = request.params["id"]
    deleted = await _db(ingress).answer(ChatStore.delete, cid)
    if isinstance(deleted, Failure) or not deleted:
        return await ingress.respond_failure(send, OPENAI_CHAT, deleted or _missing(cid))
    return await respond(send, 200, _json.encode({"object": "chat.completion.deleted", "id": cid, "deleted": True}))


@route("GET", "/v1/chat/completions/{id}/messages", dialect=OPENAI_CHAT)
async def messages(ingress, request: Request, receive, send) -> int:
    cid = request.params["id"]
    if isinstance(paged := page_query(request, "asc"), Failure):
        return await ingress.respond_failure(send, OPENAI_CHAT, paged)
    row = await _db(ingress).answer(ChatStore.get, cid)
    if isinstance(row, Failure) or row is None:
        return await ingress.respond_failure(send, OPENAI_CHAT, row or _missing(cid))
    page = item_page(msgspec.json.decode(row["messages"]), request.query.get("after"), *paged,
                     "message in this chat completion")
    if isinstance(page, Failure):
        return await ingress.respond_failure(send, OPENAI_CHAT, page)
    return await respond(send, 200, page)
