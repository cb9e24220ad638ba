"""The stored responses' database: chains, and a background response's life (queued, running, ended by its
last event, a cancel, a failure, or a restart)."""
from __future__ import annotations

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure, Frame
from sluice.schemas.responses import (CreateResponse, FunctionCallItem, InputItem, MessageItem, OutputText,
                                      ResponseEvent, new_response, sse)
from sluice.state.responses import NotFound, NotReady, Store

_json = msgspec.json.Encoder()


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(ServerConfig(model="m", model_path="/x", served_model_names=["m"], runtime_dir=str(tmp_path),
                              state_dir=str(tmp_path)))


def _response(rid: str, status="completed", previous=None, background=False, output=()):
    r = msgspec.convert({"model": "m", "input": "x", "previous_response_id": previous, "background": background},
                        CreateResponse)
    response = new_response(r, rid, 1, status)
    response.output = list(output)
    return response


def _items(*texts: str) -> bytes:
    return _json.encode([InputItem(id=f"msg_{t}", role="user", content=t) for t in texts])


def _event(rid: str, seq: int, kind: str, status="in_progress") -> bytes:
    return sse(ResponseEvent(type=f"response.{kind}", sequence_number=seq, response=_response(rid, status)))


def _frame(rid: str, seq: int, kind: str, status="in_progress") -> Frame:
    """The postproc's frame of one event (numbered `seq`); the last one carries the finished response."""
    done = kind in ("completed", "incomplete", "failed")
    event = _event(rid, seq, kind, status)
    return Frame(rid, event, done, sequence=seq + 1, stored=_json.encode(_response(rid, status)) if done else b"",
                 sizes=[len(event)])


class _Head(msgspec.Struct):
    type: str
    sequence_number: int


def event_head(event: bytes) -> _Head:
    return msgspec.json.decode(event[event.index(b"data: ") + 6:], type=_Head)


def test_a_conversation_is_every_earlier_turn_oldest_first(store):
    store.save(_json.encode(_response("r1", output=[MessageItem(id="m1", status="completed",
                                                                content=[OutputText(text="A1")])])), _items("Q1"))
    store.save(_json.encode(_response("r2", previous="r1", output=[FunctionCallItem(
        id="fc1", status="completed", call_id="c1", name="f", arguments="{}")])), _items("Q2"))
    items = store.conversation("r2")
    assert [(i.type, i.role, i.id) for i in items] == [("message", "user", "msg_Q1"), ("message", "assistant", "m1"),
                                                       ("message", "user", "msg_Q2"), ("function_call", None, "fc1")]
    assert items[3].call_id == "c1"
    with pytest.raises(NotFound):
        store.conversation("nope")
    assert store.delete("r1") and not store.delete("r1")
    assert [i.id for i in store.conversation("r2")] == ["msg_Q2", "fc1"]  # a deleted response cuts the chain


def test_a_background_response_runs_from_queued_to_its_last_event(store):
    store.save(_json.encode(_response("b1", "queued", background=True)), _items("Q"), b"job",
               _event("b1", 0, "created", "queued"))
    assert store.queued(4, []) == [("b1", b"job")] and store.queued(4, ["b1"]) == []
    with pytest.raises(NotReady):
        store.conversation("b1")
    assert store.append("b1", _frame("b1", 1, "in_progress"))
    assert store.get("b1")["status"] == "in_progress" and store.queued(4, []) == []
    assert msgspec.json.decode(store.get("b1")["response"])["status"] == "in_progress"
    assert store.events_after("b1", 0) == ([(1, _event("b1", 1, "in_progress"))], False)
    assert store.append("b1", _frame("b1", 2, "completed", "completed"))
    row = store.get("b1")
    assert row["status"] == "completed" and row["job"] is None and msgspec.json.decode(row["response"])["status"] == \
        "completed"
    events, last = store.events_after("b1", -1)
    assert [s for s, _ in events] == [0, 1, 2] and last
    assert not store.append("b1", _frame("b1", 3, "in_progress"))  # (ended: nothing more is kept)


def test_a_cancel_ends_the_stream_and_stops_the_writer_and_is_idempotent(store):
    store.save(_json.encode(_response("b1", "queued", background=True)), _items("Q"), b"job",
               _event("b1", 0, "created", "queued"))
    assert store.append("b1", _frame("b1", 1, "in_progress"))
    assert store.settled(["b1"]) == set()
    assert store.cancel("b1")["status"] == "cancelled" and store.settled(["b1"]) == {"b1"}
    assert store.cancel("b1")["status"] == "cancelled"
    events, last = store.events_after("b1", 1)
    head = event_head(events[0][1])
    assert last and len(events) == 1 and (head.type, head.sequence_number) == ("error", 2)
    assert not store.append("b1", _frame("b1", 2, "completed", "completed"))
    store.save(_json.encode(_response("f1")), _items("Q"))
    assert store.cancel("f1")["status"] == "completed"  # not a background one: as it was


def test_a_restart_fails_what_was_running_and_keeps_what_was_queued(store):
    for rid in ("b1", "b2"):
        store.save(_json.encode(_response(rid, "queued", background=True)), _items("Q"), b"job",
                   _event(rid, 0, "created", "queued"))
    store.append("b1", _frame("b1", 1, "in_progress"))
    assert store.interrupted() == ["b1"]
    response = msgspec.json.decode(store.get("b1")["response"])
    assert response["status"] == "failed" and response["error"]["code"] == "server_restarted"
    assert [event_head(e).type for _, e in store.events_after("b1", 1)[0]] == ["error", "response.failed"]
    assert store.get("b2")["status"] == "queued"
    store.fail("b2", Failure(400, "too long", "context_length_exceeded"))
    assert msgspec.json.decode(store.get("b2")["response"])["error"] == {"code": "context_length_exceeded",
                                                                         "message": "too long"}
