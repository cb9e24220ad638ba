"""A stored response that cannot be saved is never delivered as one (issue 37): the Keeper between a served
response and its client turns it into an error in the Responses API's shape, a whole body's status included."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec

from sluice.base.config import ServerConfig
from sluice.ingress.http import JSON
from sluice.ingress.responses import Keeper
from sluice.schemas.responses import CreateResponse, ResponseEvent, TextEvent, new_response, sse
from sluice.state.responses import Store

REQUEST = CreateResponse(model="m", input="hi")


def _ingress(state_dir) -> SimpleNamespace:
    return SimpleNamespace(cfg=ServerConfig(model="m", served_model_names=["m"], state_dir=str(state_dir)))


def _unusable(tmp_path):
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "state"  # (a directory under a regular file)


def _serve(keeper: Keeper, body: bytes) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def serve() -> None:
        forward = keeper.wrap(send)
        await forward({"type": "http.response.start", "status": 200, "headers": JSON})
        await forward({"type": "http.response.body", "body": body, "more_body": False})
    asyncio.run(serve())
    return sent


def _events(data: bytes) -> list[dict]:
    return [json.loads(e.split(b"data: ", 1)[1]) for e in data.split(b"\n\n") if e]


def test_a_whole_response_that_could_not_be_stored_is_a_500_instead(tmp_path):
    keeper = Keeper(_ingress(_unusable(tmp_path)), stream=False, input_items=b"[]")
    sent = _serve(keeper, msgspec.json.encode(new_response(REQUEST, "resp_1", 0, "completed")))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 500 and keeper.failed == 500
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "state_unavailable" and "--state-dir" in error["message"]


def test_a_whole_response_that_was_stored_goes_out_as_it_came(tmp_path):
    keeper = Keeper(_ingress(tmp_path), stream=False, input_items=b"[]")
    body = msgspec.json.encode(new_response(REQUEST, "resp_1", 0, "completed"))
    sent = _serve(keeper, body)
    assert sent[0]["status"] == 200 and sent[1]["body"] == body and not keeper.failed
    assert Store(_ingress(tmp_path).cfg).get("resp_1") is not None


def test_a_stream_whose_response_could_not_be_stored_ends_in_an_error_and_response_failed(tmp_path):
    keeper = Keeper(_ingress(_unusable(tmp_path)), stream=True, input_items=b"[]")
    created = new_response(REQUEST, "resp_1", 0, "in_progress")
    body = (sse(ResponseEvent(type="response.created", sequence_number=0, response=created))
            + sse(TextEvent(type="response.output_text.delta", sequence_number=1, item_id="m", output_index=0,
                            content_index=0, delta="Hi"))
            + sse(ResponseEvent(type="response.completed", sequence_number=2,
                                response=new_response(REQUEST, "resp_1", 0, "completed"))))
    sent = _serve(keeper, body)
    events = _events(sent[1]["body"])
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0), ("response.output_text.delta", 1), ("error", 2), ("response.failed", 3)]
    assert events[2]["code"] == "state_unavailable" and events[3]["response"]["status"] == "failed"
