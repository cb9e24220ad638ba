from __future__ import annotations

import sluice.ingress.app  # noqa: F401  (every route registered, as the server has them)
from sluice.ingress.dialects import DIALECTS
from sluice.ingress.openapi import FIXED, openapi_document
from sluice.ingress.routes import ROUTES


def test_openapi_lists_every_route_served():
    paths = openapi_document()["paths"]
    served = {(r.method.lower(), r.template.replace(":path", "")) for r in ROUTES}
    served |= {("post", p) for p in DIALECTS} | {("get", p) for p in FIXED}
    assert {(m, p) for p, ops in paths.items() for m in ops} == served
    assert paths["/v1/chat/completions"]["post"]["operationId"] == "openai_chat_v1_chat_completions_post"
    assert paths["/v1/completions"]["post"]["operationId"] == "openai_completion_v1_completions_post"
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert {"/v1/messages", "/v1/responses", "/v1/messages/batches", "/tokenize", "/v1/chat/completions/{id}",
            "/v1/models/{model}"} <= set(paths)
