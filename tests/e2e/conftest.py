from __future__ import annotations

import openai
import pytest

from bench.server import Server

MODEL = "builtin:tiny-chat"


@pytest.fixture(scope="session")
def server():
    s = Server("--postproc-workers", "2", "--render-workers", "2", "--ingress-workers", "2")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(server):
    """A factory: an async client belongs to the event loop it is used in."""
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
