"""The Anthropic Messages dialect at the ingress: POST /v1/messages (a generation route), count_tokens, and
Message Batches. Its errors take Anthropic's shape ({"type": "error", "error": {type, message}}) and
statuses (529 overloaded_error for a full server), and each of its responses carries a request-id."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable, TypeVar

import msgspec

from sluice import state
from sluice.ingress.dialects import Dialect, register
from sluice.ingress.http import respond, validation_error
from sluice.ingress.routes import Request, route
from sluice.ingress.tokenize import render_only
from sluice.ipc.messages import Failure
from sluice.schemas.anthropic import (BatchCreateRequest, CountTokensRequest, DeletedBatch, MessageBatch,
                                      MessagesRequest, check_conversation)
from sluice.schemas.errors import ANTHROPIC
from sluice.state.batches import BatchStore

_json = msgspec.json.Encoder()
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
RESULTS_PAGE = 512  # result lines read from the database per write
MAX_LIST_LIMIT = 1000


def request_id() -> list[tuple[bytes, bytes]]:
    return [(b"request-id", b"req_" + uuid.uuid4().hex.encode())]


MESSAGES = register(Dialect("messages", "/v1/messages", MessagesRequest, "msg_", ANTHROPIC,
                            response_headers=request_id, keepalive=PING,
                            check=check_conversation))


def _body_shape(path: str, request_type: type) -> Dialect:
    """How another route of the dialect reads its body (its errors in the dialect's shape)."""
    return Dialect("messages", path, request_type, "", ANTHROPIC,
                   check=check_conversation if request_type is CountTokensRequest else None)


_COUNT = _body_shape("/v1/messages/count_tokens", CountTokensRequest)
_BATCH = _body_shape("/v1/messages/batches", BatchCreateRequest)
_params = msgspec.json.Decoder(MessagesRequest)


class _Refused(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


async def _fail(ingress: Any, send, status: int, message: str, param: str | None = None) -> int:
    return await ingress.respond_failure(send, MESSAGES, Failure(status, message, param=param))


# ---- count_tokens ----------------------------------------------------------------------------------------------

@route("POST", "/v1/messages/count_tokens", dialect=MESSAGES)
async def count_tokens(ingress: Any, request: Request, receive, send) -> int:
    """The prompt's size, rendered by the render pool as the same request to /v1/messages would be."""
    got = await ingress.read_request(_COUNT, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    counted, _ = got
    # The generation request it stands for: max_tokens is required there, and no part of the prompt.
    body = _json.encode(MessagesRequest(**msgspec.structs.asdict(counted), max_tokens=1))
    frame = await render_only(ingress, counted.model, "messages", "count", body)
    if frame.error is not None:
        return await ingress.respond_failure(send, MESSAGES, frame.error)
    if counted.context_management is None:
        return await respond(send, 200, frame.data)
    # As Anthropic's API counts it: the prompt after the context edits, and before them
    unedited = msgspec.structs.replace(counted, context_management=None)
    original = await render_only(ingress, counted.model, "messages", "count",
                                 _json.encode(MessagesRequest(**msgspec.structs.asdict(unedited), max_tokens=1)))
    if original.error is not None:
        return await ingress.respond_failure(send, MESSAGES, original.error)
    answer = {**msgspec.json.decode(frame.data), "context_management": {
        "original_input_tokens": msgspec.json.decode(original.data)["input_tokens"]}}
    return await respond(send, 200, _json.encode(answer))


# ---- Message Batches -------------------------------------------------------------------------------------------
T = TypeVar("T")


async def _batches(ingress: Any, fn: Callable[..., T], *args: Any) -> T | Failure:
    """`fn(store, *args)` off the event loop (a database that fails under it: a Failure, in Anthropic's shape)."""
    return await state.database(ingress.cfg, BatchStore).answer(fn, *args)


async def _answer(ingress: Any, send, got: Any) -> int:
    """A store's answer as the response: its JSON, or the failure it is."""
    if isinstance(got, Failure):
        return await ingress.respond_failure(send, MESSAGES, got)
    return await respond(send, 200, _json.encode(got))


@route("POST", "/v1/messages/batches", dialect=MESSAGES)
async def create_batch(ingress: Any, request: Request, receive, send) -> int:
    got = await ingress.read_request(_BATCH, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    try:
        requests = await asyncio.to_thread(_checked, got[0])
    except _Refused as e:
        return await ingress.respond_failure(send, MESSAGES, e.failure)
    return await _answer(ingress, send, await _batches(ingress, BatchStore.create, requests))


def _checked(body: BatchCreateRequest) -> list[tuple[str, bytes]]:
    """Each request checked as /v1/messages would check it (off the event loop: a batch holds up to 100,000
    requests): the (custom_id, params JSON) to store."""
    seen: set[str] = set()
    for i, item in enumerate(body.requests):
        if item.custom_id in seen:
            raise _Refused(Failure(400, f"custom_id {item.custom_id!r} is used more than once",
                                   param=f"requests[{i}].custom_id"))
        seen.add(item.custom_id)
        try:
            params = _params.decode(item.params)
        except msgspec.MsgspecError as e:
            message, param = validation_error(e)
            raise _Refused(Failure(400, message, param=f"requests[{i}].params" + (f".{param}" if param else "")))
        if params.stream:
            raise _Refused(Failure(400, "a batch's requests do not stream", param=f"requests[{i}].params.stream"))
    return [(item.custom_id, bytes(item.params)) for item in body.requests]


@route("GET", "/v1/messages/batches", dialect=MESSAGES)
async def list_batches(ingress: Any, request: Request, receive, send) -> int:
    query = request.query
    limit = request.integer("limit", 20, 1, MAX_LIST_LIMIT)
    if limit is None:
        return await _fail(ingress, send, 400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    before, after = query.get("before_id"), query.get("after_id")
    if before and after:
        return await _fail(ingress, send, 400, "send before_id or after_id, not both", "before_id")
    page = await _batches(ingress, BatchStore.page, limit, before, after)
    if page is None:
        return await _fail(ingress, send, 404, f"no message batch {before or after!r}",
                           "before_id" if before else "after_id")
    return await _answer(ingress, send, page)


@route("GET", "/v1/messages/batches/{id}", dialect=MESSAGES)
async def get_batch(ingress: Any, request: Request, receive, send) -> int:
    return await _batch_reply(ingress, request, send, BatchStore.get)


@route("POST", "/v1/messages/batches/{id}/cancel", dialect=MESSAGES)
async def cancel_batch(ingress: Any, request: Request, receive, send) -> int:
    return await _batch_reply(ingress, request, send, BatchStore.cancel)


async def _batch_reply(ingress: Any, request: Request, send, operation: Callable[..., MessageBatch | None]) -> int:
    """The batch after the store's `operation` on it (get, cancel), or a 404."""
    batch = await _batches(ingress, operation, request.params["id"])
    if batch is None:
        return await _not_found(ingress, send, request)
    return await _answer(ingress, send, batch)


@route("DELETE", "/v1/messages/batches/{id}", dialect=MESSAGES)
async def delete_batch(ingress: Any, request: Request, receive, send) -> int:
    batch_id = request.params["id"]
    outcome = await _batches(ingress, BatchStore.delete, batch_id)
    if outcome is None:
        return await _not_found(ingress, send, request)
    if isinstance(outcome, Failure):
        return await _answer(ingress, send, outcome)
    if outcome != "deleted":
        return await _fail(ingress, send, 400, f"message batch {batch_id} is {outcome}: only an ended batch can be "
                           "deleted (cancel it first)")
    return await _answer(ingress, send, DeletedBatch(batch_id))


@route("GET", "/v1/messages/batches/{id}/results", dialect=MESSAGES)
async def batch_results(ingress: Any, request: Request, receive, send) -> int:
    """The results as JSONL, read from the database a page at a time as the client takes them. The first page
    is read before the response begins (a failure then is an error in Anthropic's shape); a failure after it
    cuts the connection, so that a client never takes a cut list for the whole."""
    batch_id = request.params["id"]
    batch = await _batches(ingress, BatchStore.get, batch_id)
    if batch is None:
        return await _not_found(ingress, send, request)
    if isinstance(batch, Failure):
        return await _answer(ingress, send, batch)
    if batch.processing_status != "ended":
        return await _fail(ingress, send, 400, f"message batch {batch_id} is {batch.processing_status}: its "
                           "results are ready once it has ended")
    lines = await _batches(ingress, BatchStore.results, batch_id, -1, RESULTS_PAGE)
    if isinstance(lines, Failure):
        return await _answer(ingress, send, lines)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-jsonl")]})
    try:
        while lines:
            await send({"type": "http.response.body", "body": b"".join(line for _, line in lines), "more_body": True})
            lines = await _batches(ingress, BatchStore.results, batch_id, lines[-1][0], RESULTS_PAGE)
            if isinstance(lines, Failure):
                raise ResultsCut(lines.message)
        await send({"type": "http.response.body", "body": b""})
    except OSError:  # the client left
        pass
    return 200


class ResultsCut(Exception):
    """The state database failed while a batch's results were being sent: the connection is cut."""


async def _not_found(ingress: Any, send, request: Request) -> int:
    return await _fail(ingress, send, 404, f"no message batch {request.params['id']!r}")
