"""vLLM's POST /tokenize and POST /detokenize: the render pool answers them (the prompt rendered as generation
renders it, or ids decoded), no engine."""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable

import msgspec

from sluice.ingress.dialects import Dialect
from sluice.ingress.http import respond
from sluice.ingress.pipeline import DISCONNECTED, TIMED_OUT
from sluice.ingress.routes import Request, route
from sluice.ipc.messages import Answer, Endpoint, Failure, Frame, RenderJob
from sluice.schemas.errors import OPENAI
from sluice.schemas.openai import DetokenizeRequest, TokenizeRequest, TokenizeResponse

_TOKENIZE = Dialect("chat", "/tokenize", TokenizeRequest, "", OPENAI)
_DETOKENIZE = Dialect("chat", "/detokenize", DetokenizeRequest, "", OPENAI)
_json = msgspec.json.Encoder()
_answer = msgspec.json.Decoder(TokenizeResponse)


@route("POST", "/tokenize")
async def tokenize(ingress: Any, request: Request, receive, send) -> int:
    got = await ingress.read_request(_TOKENIZE, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    r, _ = got
    if (r.prompt is None) == (r.messages is None):
        return await ingress.respond_failure(send, _TOKENIZE, Failure(400, "send prompt or messages (one of them)"))
    model = r.model or ingress.cfg.served_model_names[0]
    if r.messages is not None:  # rendered as this chat request would be
        endpoint: Endpoint = "chat"
        body = {"model": model, "messages": r.messages, "add_generation_prompt": r.add_generation_prompt,
                "continue_final_message": r.continue_final_message, "tools": r.tools,
                "chat_template_kwargs": r.chat_template_kwargs}
    else:
        endpoint, body = "completions", {"model": model, "prompt": r.prompt}
    frame = await render_only(ingress, model, endpoint, "tokens", _json.encode(
        {k: v for k, v in body.items() if v is not None}))
    return await _answer_with(ingress, send, _TOKENIZE, frame, None if r.return_token_strs else _without_strings)


@route("POST", "/detokenize")
async def detokenize(ingress: Any, request: Request, receive, send) -> int:
    got = await ingress.read_request(_DETOKENIZE, receive, send, request.scope["headers"])
    if isinstance(got, int):
        return got
    r, body = got
    frame = await render_only(ingress, r.model or ingress.cfg.served_model_names[0], "completions", "text", body)
    return await _answer_with(ingress, send, _DETOKENIZE, frame)


def _without_strings(data: bytes) -> bytes:
    answer = _answer.decode(data)
    answer.token_strs = None
    return _json.encode(answer)


async def _answer_with(ingress: Any, send, dialect: Dialect, frame: Frame,
                       edit: Callable[[bytes], bytes] | None = None) -> int:
    """The render pool's answer as the response (`edit`ed), or its failure in the dialect's shape."""
    if frame.error is not None:
        return await ingress.respond_failure(send, dialect, frame.error)
    return await respond(send, 200, frame.data if edit is None else edit(frame.data))


async def render_only(ingress: Any, model: str, endpoint: Endpoint, answer: Answer, body: bytes) -> Frame:
    """The render pool's answer to a job that asks it alone (RenderJob.answer), or the failure that stands
    for it (the model refused, or no answer in time)."""
    rid = "tok_" + uuid.uuid4().hex
    if (refused := ingress.refusal(model)) is not None:
        return Frame(rid, b"", True, refused)
    q = ingress.open(rid)
    try:
        ingress.submit(rid, RenderJob(rid, endpoint, body, ingress.address, time.time(), answer=answer))
        frame = await q.get()
    finally:
        ingress.close(rid)
    if frame is TIMED_OUT or frame is DISCONNECTED:
        return Frame(rid, b"", True, Failure(504, "the request did not finish in time", "timeout"))
    return frame
