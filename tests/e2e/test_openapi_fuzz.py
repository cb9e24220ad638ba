"""schemathesis over the served OpenAPI document: no 5xx, every error in the OpenAI shape."""
from __future__ import annotations

import httpx
import pytest

from bench.server import Server
from ingress.openapi import openapi_document

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def replay_server():
    # the replay runner: every code path but the model, so thousands of generated requests stay cheap
    s = Server("--runner", "replay", "--max-model-len", "256", "--num-kv-blocks", "4096")
    yield s
    assert s.stop() == 0, s.output()


def test_the_served_document_is_this_one(replay_server):
    assert httpx.get(replay_server.url + "/openapi.json").json() == openapi_document()


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_never_get_a_5xx(case, replay_server):
    response = case.call(base_url=replay_server.url, timeout=60)
    assert response.status_code < 500, (case.body, response.text)
    if response.status_code >= 400:
        assert {"message", "type", "param", "code"} <= set(response.json()["error"])
