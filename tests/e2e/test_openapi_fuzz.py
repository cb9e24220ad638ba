"""schemathesis over the served OpenAPI document (every route): no 5xx, every error in its route's dialect's
shape. The server runs inside deploy/middleware_example.py's middleware, so the fuzzing goes through them."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from bench.server import Server
from sluice.ingress.openapi import openapi_document

schema = schemathesis.openapi.from_dict(openapi_document())


EXAMPLE = "deploy/middleware_example.py"
HEALTH = ("/health", "/ready", "/health_generate")  # (a 503 there is an answer: busy, or stalled)


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory):
    # the replay runner: every code path but the model, so thousands of generated requests stay cheap
    s = Server("--runner", "replay", "--max-model-len", "256", "--num-kv-blocks", "4096",
               "--state-dir", str(tmp_path_factory.mktemp("state")),
               "--middleware", f"{EXAMPLE}:request_id", "--middleware", f"{EXAMPLE}:server_timing")
    yield s
    assert s.stop() == 0, s.output()


def test_the_served_document_is_this_one(replay_server):
    assert httpx.get(replay_server.url + "/openapi.json").json() == openapi_document()


def test_the_example_middleware_sees_requests_in_the_order_given(replay_server):
    r = httpx.get(replay_server.url + "/v1/models", headers={"x-request-id": "r-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "r-1"
    assert 'desc="r-1"' in r.headers["server-timing"]  # (the inner one saw what the outer one set)


# Bodies are where the validation is: each route that takes one gets more cases than one that takes a path
# and a query (a few cover an id's 404 and a bad query's 400).
@schema.include(method="POST").parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_bodies_never_get_a_5xx(case, replay_server):
    _check(case, replay_server)


@schema.exclude(method="POST").parametrize()
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_paths_and_queries_never_get_a_5xx(case, replay_server):
    _check(case, replay_server)


def _check(case, server) -> None:
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500 or (case.path in HEALTH and response.status_code == 503), \
        (case.path, case.body, response.text)
    if response.status_code >= 400:
        if case.path.startswith("/v1/messages"):
            body = response.json()
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
        else:
            assert {"message", "type", "param", "code"} <= set(response.json()["error"])
