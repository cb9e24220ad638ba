"""The Anthropic Messages dialect at the ingress: POST /v1/messages (a generation route), count_tokens, and
Message Batches. Its errors take Anthropic's shape ({"type": "error", "error": {type, message}}) and
statuses (529 overloaded_error for a full server), and each of its responses carries a request-id."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec

from ingress.dialects import Dialect, register
from ingress.http import respond, validation_error
from ingress.pipeline import DISCONNECTED, TIMED_OUT
from ingress.routes import Request, route
from ipc.anthropic import (BatchCreateRequest, CountTokensRequest, DeletedBatch, MessageBatch, MessagesRequest,
                           error_response)
from ipc.messages import Failure, Frame, RenderJob
from sluice.batches import BatchStore

_json = msgspec.json.Encoder()
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
RESULTS_PAGE = 512  # result lines read from the database per write
MAX_LIST_LIMIT = 1000


def error_body(f: Failure) -> bytes:
    return _json.encode(error_response(f.status, f.message, f.param))


def stream_error(f: Failure) -> bytes:
    return b"event: error\ndata: " + error_body(f) + b"\n\n"


def request_id() -> list[tuple[bytes, bytes]]:
    return [(b"request-id", b"req_" + uuid.uuid4().hex.encode())]


MESSAGES = register(Dialect("messages", "/v1/messages", MessagesRequest, "msg_", error_body, stream_error,
                            statuses={503: 529}, response_headers=request_id, keepalive=PING))


def _body_shape(path: str, request_type: type) -> Dialect:
    """How another route of the dialect reads its body (its errors in the dialect's shape)."""
    return Dialect("messages", path, request_type, "", error_body, stream_error)


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
    got = await ingress.read_request(_COUNT, receive, send)
    if isinstance(got, int):
        return got
    counted, _ = got
    if (refused := ingress.refusal(counted.model)) is not None:
        return await ingress.respond_failure(send, MESSAGES, refused)
    # The generation request it stands for: max_tokens is required there, and no part of the prompt.
    body = _json.encode(MessagesRequest(**msgspec.structs.asdict(counted), max_tokens=1))
    frame = await _render_only(ingress, body)
    if frame.error is not None:
        return await ingress.respond_failure(send, MESSAGES, frame.error)
    return await respond(send, 200, frame.data)


async def _render_only(ingress: Any, body: bytes) -> Frame:
    rid = "count_" + uuid.uuid4().hex
    q = ingress.open(rid)
    try:
        ingress.submit(rid, RenderJob(rid, "messages", body, ingress.address, time.time(), count_only=True))
        frame = await q.get()
    finally:
        ingress.close(rid)
    if frame is TIMED_OUT or frame is DISCONNECTED:
        return Frame(rid, b"", True, Failure(504, "the request did not finish in time", "timeout"))
    return frame


# ---- Message Batches -------------------------------------------------------------------------------------------

_stores: list[BatchStore] = []  # this worker's connection to the state database, once it needs one


def _store(ingress: Any) -> BatchStore:
    if not _stores:
        _stores.append(BatchStore(ingress.cfg))
    return _stores[0]


@route("POST", "/v1/messages/batches", dialect=MESSAGES)
async def create_batch(ingress: Any, request: Request, receive, send) -> int:
    got = await ingress.read_request(_BATCH, receive, send)
    if isinstance(got, int):
        return got
    try:
        batch = await asyncio.to_thread(_create, _store(ingress), got[0])
    except _Refused as e:
        return await ingress.respond_failure(send, MESSAGES, e.failure)
    return await respond(send, 200, _json.encode(batch))


def _create(store: BatchStore, body: BatchCreateRequest) -> MessageBatch:
    """Checks each request as /v1/messages would, then stores the batch (off the event loop: a batch holds up
    to 100,000 requests)."""
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
    return store.create((item.custom_id, bytes(item.params)) for item in body.requests)


@route("GET", "/v1/messages/batches", dialect=MESSAGES)
async def list_batches(ingress: Any, request: Request, receive, send) -> int:
    query = request.query
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        return await _fail(ingress, send, 400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    before, after = query.get("before_id"), query.get("after_id")
    if before and after:
        return await _fail(ingress, send, 400, "send before_id or after_id, not both", "before_id")
    page = await asyncio.to_thread(_store(ingress).page, int(limit), before, after)
    if page is None:
        return await _fail(ingress, send, 404, f"no message batch {before or after!r}",
                           "before_id" if before else "after_id")
    return await respond(send, 200, _json.encode(page))


@route("GET", "/v1/messages/batches/{id}", dialect=MESSAGES)
async def get_batch(ingress: Any, request: Request, receive, send) -> int:
    return await _batch_reply(ingress, request, send, "get")


@route("POST", "/v1/messages/batches/{id}/cancel", dialect=MESSAGES)
async def cancel_batch(ingress: Any, request: Request, receive, send) -> int:
    return await _batch_reply(ingress, request, send, "cancel")


async def _batch_reply(ingress: Any, request: Request, send, operation: str) -> int:
    """The batch after the store's `operation` on it (get, cancel), or a 404."""
    batch = await asyncio.to_thread(getattr(_store(ingress), operation), request.params["id"])
    if batch is None:
        return await _not_found(ingress, send, request)
    return await respond(send, 200, _json.encode(batch))


@route("DELETE", "/v1/messages/batches/{id}", dialect=MESSAGES)
async def delete_batch(ingress: Any, request: Request, receive, send) -> int:
    batch_id = request.params["id"]
    outcome = await asyncio.to_thread(_store(ingress).delete, batch_id)
    if outcome is None:
        return await _not_found(ingress, send, request)
    if outcome != "deleted":
        return await _fail(ingress, send, 400, f"message batch {batch_id} is {outcome}: only an ended batch can be "
                           "deleted (cancel it first)")
    return await respond(send, 200, _json.encode(DeletedBatch(batch_id)))


@route("GET", "/v1/messages/batches/{id}/results", dialect=MESSAGES)
async def batch_results(ingress: Any, request: Request, receive, send) -> int:
    """The results as JSONL, read from the database a page at a time as the client takes them."""
    store, batch_id = _store(ingress), request.params["id"]
    batch = await asyncio.to_thread(store.get, batch_id)
    if batch is None:
        return await _not_found(ingress, send, request)
    if batch.processing_status != "ended":
        return await _fail(ingress, send, 400, f"message batch {batch_id} is {batch.processing_status}: its "
                           "results are ready once it has ended")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-jsonl")]})
    after = -1
    try:
        while lines := await asyncio.to_thread(store.results, batch_id, after, RESULTS_PAGE):
            await send({"type": "http.response.body", "body": b"".join(line for _, line in lines), "more_body": True})
            after = lines[-1][0]
        await send({"type": "http.response.body", "body": b""})
    except OSError:  # the client left
        pass
    return 200


async def _not_found(ingress: Any, send, request: Request) -> int:
    return await _fail(ingress, send, 404, f"no message batch {request.params['id']!r}")
