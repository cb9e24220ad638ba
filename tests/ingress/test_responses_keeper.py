"""A stored response that cannot be saved is never delivered as one (issue 37), and the stored response is the
one the postproc built (issue 32: Frame.stored, numbered by Frame.sequence; nothing read back from the SSE).
Served through the ingress's relay of frames to the client, with the Responses route's keeper."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import msgspec

from sluice.base.config import ServerConfig
from sluice.ingress.app import Ingress
from sluice.ingress.pipeline import FrameQueue
from sluice.ingress.responses import RESPONSES, Kept
from sluice.ipc.messages import Frame
from sluice.schemas import errors
from sluice.schemas.responses import CreateResponse, ResponseEvent, TextEvent, new_response, sse
from sluice.state.responses import Store

REQUEST = CreateResponse(model="m", input="hi")


def _cfg(state_dir) -> ServerConfig:
    return ServerConfig(model="m", served_model_names=["m"], state_dir=str(state_dir))


def _unusable(tmp_path):
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "state"  # (a directory under a regular file)


def _relay(state_dir, frames: list[Frame], stream: bool) -> tuple[list[dict], int]:
    """The frames through Ingress._relay, as the Responses route serves them (its keeper, its stream errors)."""
    ingress = object.__new__(Ingress)
    ingress.cfg, ingress.draining = _cfg(state_dir), False
    kept = Kept(SimpleNamespace(cfg=ingress.cfg), REQUEST, "resp_1", 0, b"[]")
    dialect = dataclasses.replace(RESPONSES, errors=dataclasses.replace(errors.RESPONSES, stream=kept.stream_error),
                                  keepalive=b"")
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def serve() -> int:
        q = FrameQueue(asyncio.current_task())
        for frame in frames:
            q.put_nowait(frame)
        _, status = await ingress._relay(q, send, dialect, stream, "resp_1", kept.keep)
        return status
    return sent, asyncio.run(serve())


def _events(data: bytes) -> list[dict]:
    return [json.loads(e.split(b"data: ", 1)[1]) for e in data.split(b"\n\n") if e]


def _stream() -> list[Frame]:
    """A stream in two frames, as the postproc sends it: the last one carries the finished response."""
    done = new_response(REQUEST, "resp_1", 0, "completed")
    first = sse(ResponseEvent(type="response.created", sequence_number=0,
                              response=new_response(REQUEST, "resp_1", 0, "in_progress")))
    last = [sse(TextEvent(type="response.output_text.delta", sequence_number=1, item_id="m", output_index=0,
                          content_index=0, delta="Hi")),
            sse(ResponseEvent(type="response.completed", sequence_number=2, response=done))]
    return [Frame("resp_1", first, sequence=1, sizes=[len(first)]),
            Frame("resp_1", b"".join(last), True, stored=msgspec.json.encode(done), sequence=3,
                  sizes=[len(e) for e in last])]


def test_a_whole_response_that_could_not_be_stored_is_a_500_instead(tmp_path):
    body = msgspec.json.encode(new_response(REQUEST, "resp_1", 0, "completed"))
    sent, status = _relay(_unusable(tmp_path), [Frame("resp_1", body, True)], stream=False)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 500 == status
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "state_unavailable" and "--state-dir" in error["message"]


def test_a_whole_response_that_was_stored_goes_out_as_it_came(tmp_path):
    body = msgspec.json.encode(new_response(REQUEST, "resp_1", 0, "completed"))
    sent, status = _relay(tmp_path, [Frame("resp_1", body, True)], stream=False)
    assert sent[0]["status"] == 200 == status and sent[1]["body"] == body
    assert Store(_cfg(tmp_path)).get("resp_1")["status"] == "completed"


def test_a_stream_stores_the_response_its_last_frame_carries(tmp_path):
    sent, status = _relay(tmp_path, _stream(), stream=True)
    events = _events(b"".join(m.get("body", b"") for m in sent))
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0), ("response.output_text.delta", 1), ("response.completed", 2)]
    assert json.loads(Store(_cfg(tmp_path)).get("resp_1")["response"])["status"] == "completed"


def test_a_stream_whose_response_could_not_be_stored_ends_in_an_error_and_response_failed(tmp_path):
    sent, status = _relay(_unusable(tmp_path), _stream(), stream=True)
    events = _events(b"".join(m.get("body", b"") for m in sent))
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0), ("response.output_text.delta", 1), ("error", 2), ("response.failed", 3)]
    assert events[2]["code"] == "state_unavailable" and events[3]["response"]["status"] == "failed"
    assert events[3]["response"]["id"] == "resp_1"
