"""A previous_response_id chain is walked with a visited set and a depth limit (issue 37): stored rows that loop
end the walk, each response comes in once."""
from __future__ import annotations

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.schemas.responses import CreateResponse, InputItem, new_response
from sluice.state import responses as responses_store
from sluice.state.responses import Store

_json = msgspec.json.Encoder()


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(ServerConfig(model="m", model_path="/x", served_model_names=["m"], runtime_dir=str(tmp_path),
                              state_dir=str(tmp_path)))


def _save(store: Store, rid: str, previous: str | None = None) -> None:
    r = msgspec.convert({"model": "m", "input": "x", "previous_response_id": previous}, CreateResponse)
    store.save(_json.encode(new_response(r, rid, 1, "completed")),
               _json.encode([InputItem(id=f"msg_{rid}", role="user", content=rid)]))


def test_a_chain_whose_rows_loop_ends_with_each_response_once(store, caplog):
    _save(store, "r1")
    _save(store, "r2", previous="r1")
    _save(store, "r3", previous="r2")
    store.conn.execute("UPDATE responses SET previous_response_id = 'r3' WHERE id = 'r1'")  # damaged: r1 -> r3
    assert [i.id for i in store.conversation("r3")] == ["msg_r1", "msg_r2", "msg_r3"]
    assert "loops back to r3" in caplog.text
    store.conn.execute("UPDATE responses SET previous_response_id = 'r1' WHERE id = 'r1'")  # r1 -> itself
    assert [i.id for i in store.conversation("r2")] == ["msg_r1", "msg_r2"]


def test_a_chain_longer_than_the_limit_begins_at_the_oldest_it_reaches(store, monkeypatch):
    monkeypatch.setattr(responses_store, "MAX_CHAIN", 3)
    for i in range(6):
        _save(store, f"r{i}", previous=f"r{i - 1}" if i else None)
    assert [i.id for i in store.conversation("r5")] == ["msg_r3", "msg_r4", "msg_r5"]
