"""The Responses API's routes: POST /v1/responses (served here, queued for the background owner, stored),
GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel.

A response's id is its engine request's. What is stored, and who writes it: sluice/state/responses.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, Callable, TypeVar

import msgspec

from sluice import state
from sluice.base import sealing, tracing
from sluice.ingress.dialects import Dialect
from sluice.ingress.http import SSE, respond
from sluice.ingress.paging import item_page, page_query
from sluice.ingress.routes import Request, route
from sluice.ipc.messages import Failure, Frame
from sluice.schemas import errors
from sluice.schemas.openai import INT64_MAX
from sluice.schemas.responses import (CreateResponse, ErrorEvent, InputItem, Part, RenderBody, Response, ResponseError,
                                      ResponseEvent, new_response, sse)
from sluice.schemas.responses_tools import left_out, left_out_message
from sluice.state.database import POLL_S
from sluice.state.responses import NotFound, NotReady, Store

log = logging.getLogger("sluice.ingress")
T = TypeVar("T")
_json = msgspec.json.Encoder()
_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


RESPONSES = Dialect(endpoint="responses", path="/v1/responses", request_type=CreateResponse, id_prefix="resp_",
                    errors=errors.RESPONSES)
async def _state(ingress, fn: Callable[..., T], *args) -> T | Failure:
    """`fn(store, *args)` on this worker's database (opened on first use; a failure under it: a Failure)."""
    return await state.database(ingress.cfg, Store).answer(fn, *args)


def _missing(rid: str) -> Failure:
    return Failure(404, f"no response with id {rid!r}", "not_found")


# ---- POST /v1/responses --------------------------------------------------------

@route("POST", "/v1/responses", dialect=RESPONSES)
async def create(ingress, request: Request, receive, send) -> int:
    got = await ingress.read_request(RESPONSES, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    r: CreateResponse = got[0]
    if (refused := ingress.refusal(r.model)) is not None:
        return await ingress.respond_failure(send, RESPONSES, refused)
    if (refused := _tools_left_out(ingress.cfg, r)) is not None:
        return await ingress.respond_failure(send, RESPONSES, refused)
    state_dir = str(state.database_path(ingress.cfg).parent)
    if (keyless := await _sealing_key(ingress.cfg, state_dir, r)) is not None:
        return await ingress.respond_failure(send, RESPONSES, keyless)
    history: list[InputItem] | Failure = []
    if r.previous_response_id is not None:
        history = await _conversation(ingress, r.previous_response_id)
    if isinstance(history, Failure):
        return await ingress.respond_failure(send, RESPONSES, history)
    items = _json.encode([_stored(item) for item in r.items])
    if r.background:
        return await _queue(ingress, r, RenderBody(r, history, state_dir=state_dir), items, receive, send)
    if r.store is not False and isinstance(usable := await _state(ingress, Store.check), Failure):
        return await ingress.respond_failure(send, RESPONSES, usable)  # (before the work, not after it)
    rid, created_at = RESPONSES.id_prefix + uuid.uuid4().hex, int(time.time())
    kept = Kept(ingress, r, rid, created_at, items if r.store is not False else None)
    dialect = dataclasses.replace(RESPONSES, errors=dataclasses.replace(errors.RESPONSES, stream=kept.stream_error))
    body = _json.encode(RenderBody(r, history, created_at=created_at, state_dir=state_dir))
    return await ingress.generate(dialect, receive, send, body=body, request=r, rid=rid,
                                  keep=kept.keep if kept.items is not None else None,
                                  trace=tracing.from_headers(request.scope["headers"]))


_told: set[str] = set()  # the tool types this worker has logged as left out


def _tools_left_out(cfg, r: CreateResponse) -> Failure | None:
    """The one policy for tools this server does not offer the model (sluice.schemas.responses.left_out): a 400 naming
    the first under --strict-tools; else each is left out of the prompt, named in the response's `warnings`,
    and logged (once per type and worker: every response names them)."""
    for param, kind in left_out(r.tools):
        if cfg.strict_tools:
            return Failure(400, f"{left_out_message(param, kind)} (--strict-tools refuses it)", param=param)
        if kind not in _told:
            _told.add(kind)
            log.warning("POST /v1/responses: %s; the response says so in `warnings` (logged once per tool type; "
                        "--strict-tools refuses such requests)", left_out_message(param, kind))
    return None


async def _sealing_key(cfg, state_dir: str, r: CreateResponse) -> Failure | None:
    """The state directory's key for sealed reasoning, made now if the request needs it and there is none yet
    (so that the workers that seal and open it find it): a directory that cannot hold it is an error."""
    if not r.sealed_reasoning and not any(item.encrypted_content for item in r.items):
        return None
    try:
        await asyncio.to_thread(sealing.sealer, state_dir)
    except OSError as e:
        return state.unavailable(cfg, e)
    return None


async def _conversation(ingress, rid: str) -> list[InputItem] | Failure:
    try:
        return await _state(ingress, Store.conversation, rid)
    except NotFound:
        return Failure(404, f"previous_response_id {rid!r} names no stored response", "not_found",
                       "previous_response_id")
    except NotReady as e:
        return Failure(400, f"response {e} is not finished: chain from it once it is", param="previous_response_id")


def _stored(item: InputItem) -> dict[str, Any]:
    """An input item as input_items lists it: with its type, an id and a status, a message's text in parts."""
    content = item.content
    if item.type == "message" and isinstance(content, str):
        content = [Part("output_text" if item.role == "assistant" else "input_text", content)]
    stored = msgspec.structs.replace(item, id=item.id or _ID_PREFIX[item.type] + uuid.uuid4().hex, content=content,
                                     status=item.status or "completed")
    return {"type": item.type, **msgspec.to_builtins(stored)}


async def _queue(ingress, r: CreateResponse, render: RenderBody, items: bytes, receive, send) -> int:
    """Stores a background response, queued for the owner; answers with it, or follows its stream."""
    created_at = int(time.time())
    response = new_response(r, RESPONSES.id_prefix + uuid.uuid4().hex, created_at, "queued")
    job = _json.encode(msgspec.structs.replace(render, created_at=created_at, background=True))
    created = sse(ResponseEvent(type="response.created", sequence_number=0, response=response))
    body = _json.encode(response)
    if isinstance(saved := await _state(ingress, Store.save, body, items, job, created), Failure):
        return await ingress.respond_failure(send, RESPONSES, saved)
    if r.stream:
        return await _follow(ingress, response.id, -1, receive, send)
    return await respond(send, 200, body)


class Kept:
    """A served response and what it leaves behind: the finished response (the last frame's Frame.stored, or
    the whole body) stored, when asked, before its last bytes go out, so that a chained request sent the
    moment they arrive finds it; and the events that end its stream in an error, numbered after the events
    sent (Frame.sequence). A response that could not be stored is not delivered as one: it ends in the error."""

    def __init__(self, ingress, request: CreateResponse, rid: str, created_at: int, items: bytes | None) -> None:
        self.ingress = ingress
        self.request = request
        self.rid = rid
        self.created_at = created_at
        self.items = items  # its input items, as input_items lists them (None: not stored)

    async def keep(self, frame: Frame) -> Failure | None:
        """Stores the finished response; or, for a stream that failed after it began, the failed one."""
        if frame.error is not None and frame.sequence == 0:
            return None
        response = _json.encode(self._failed(frame.error)) if frame.error is not None else frame.stored or frame.data
        saved = await _state(self.ingress, Store.save, response, self.items)
        return saved if isinstance(saved, Failure) else None

    def _failed(self, failure: errors.Failure) -> Response:
        failed = new_response(self.request, self.rid, self.created_at, "failed")
        failed.error = ResponseError(failure.code or "server_error", failure.message)
        return failed

    def stream_error(self, failure: errors.Failure, sequence: int) -> bytes:
        """An error after the stream began: an error event, then response.failed (once response.created went)."""
        error = ErrorEvent(sequence_number=sequence, code=failure.code, message=failure.message,
                           param=failure.param)
        if sequence == 0:
            return sse(error)
        return sse(error) + sse(ResponseEvent(type="response.failed", sequence_number=sequence + 1,
                                              response=self._failed(failure)))


# ---- a stored response -----------------------------------------------------------

@route("GET", "/v1/responses/{id}", dialect=RESPONSES)
async def retrieve(ingress, request: Request, receive, send) -> int:
    rid, query = request.params["id"], request.query
    if query.get("include"):
        return await ingress.respond_failure(send, RESPONSES, Failure(
            400, f"include {query['include']!r} is not supported", param="include"))
    after = request.integer("starting_after", -1, -1, INT64_MAX)
    if after is None:
        return await ingress.respond_failure(send, RESPONSES, Failure(
            400, f"starting_after is a sequence number (an integer from -1 to {INT64_MAX})", param="starting_after"))
    row = await _state(ingress, Store.get, rid)
    if isinstance(row, Failure) or row is None:
        return await ingress.respond_failure(send, RESPONSES, row or _missing(rid))
    if query.get("stream", "false").lower() != "true":
        return await respond(send, 200, row["response"])
    if not row["background"]:
        return await ingress.respond_failure(send, RESPONSES, Failure(
            400, "only a background response can be streamed again", param="stream"))
    return await _follow(ingress, rid, after, receive, send)


async def _follow(ingress, rid: str, after: int, receive, send) -> int:
    """A background response's stream from the event after `after`, as the owner stores it, to its end (or
    until the client leaves, or the response is deleted). The state database failing before the stream
    begins is an error response; after, an error event that ends it."""
    got = await _state(ingress, Store.events_after, rid, after)
    if isinstance(got, Failure) or got is None:
        return await ingress.respond_failure(send, RESPONSES, got or _missing(rid))
    left = asyncio.create_task(_disconnected(receive))
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    try:
        while got is not None:  # (None: deleted meanwhile)
            if isinstance(got, Failure):
                error = ErrorEvent(sequence_number=after + 1, code=got.code, message=got.message)
                await send({"type": "http.response.body", "body": sse(error), "more_body": True})
                break
            events, last = got
            if events:
                after = events[-1][0]
                await send({"type": "http.response.body", "body": b"".join(e for _, e in events), "more_body": True})
            if last:
                break
            done, _ = await asyncio.wait([left], timeout=POLL_S)
            if done:
                return 200
            got = await _state(ingress, Store.events_after, rid, after)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:
        pass
    finally:
        left.cancel()
    return 200


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@route("DELETE", "/v1/responses/{id}", dialect=RESPONSES)
async def delete(ingress, request: Request, receive, send) -> int:
    rid = request.params["id"]
    cancelled = await _state(ingress, Store.cancel, rid)  # (a running one stops first)
    if isinstance(cancelled, Failure) or cancelled is None:
        return await ingress.respond_failure(send, RESPONSES, cancelled or _missing(rid))
    ingress.abort(rid)
    if isinstance(deleted := await _state(ingress, Store.delete, rid), Failure):
        return await ingress.respond_failure(send, RESPONSES, deleted)
    return await respond(send, 200, _json.encode({"id": rid, "object": "response.deleted", "deleted": True}))


@route("POST", "/v1/responses/{id}/cancel", dialect=RESPONSES)
async def cancel(ingress, request: Request, receive, send) -> int:
    """Stops a background response; cancelling a cancelled one again answers the same."""
    rid = request.params["id"]
    row = await _state(ingress, Store.cancel, rid)
    if isinstance(row, Failure) or row is None:
        return await ingress.respond_failure(send, RESPONSES, row or _missing(rid))
    if not row["background"]:
        return await ingress.respond_failure(send, RESPONSES, Failure(
            400, "only a background response can be cancelled", param="response_id"))
    if row["status"] != "cancelled":
        return await ingress.respond_failure(send, RESPONSES, Failure(
            400, f"the response is {row['status']}: it can no longer be cancelled", param="response_id"))
    ingress.abort(rid)  # (the owner sees the cancel too, and closes its request)
    return await respond(send, 200, row["response"])


@route("GET", "/v1/responses/{id}/input_items", dialect=RESPONSES)
async def input_items(ingress, request: Request, receive, send) -> int:
    rid = request.params["id"]
    if isinstance(paged := page_query(request, "desc"), Failure):
        return await ingress.respond_failure(send, RESPONSES, paged)
    row = await _state(ingress, Store.get, rid)
    if isinstance(row, Failure) or row is None:
        return await ingress.respond_failure(send, RESPONSES, row or _missing(rid))
    page = item_page(msgspec.json.decode(row["input_items"]), request.query.get("after"), *paged,
                     "input item in this response")
    if isinstance(page, Failure):
        return await ingress.respond_failure(send, RESPONSES, page)
    return await respond(send, 200, page)

