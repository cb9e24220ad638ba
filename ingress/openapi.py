"""The OpenAPI document, generated from the same msgspec Structs that validate requests."""
from __future__ import annotations

import msgspec

from ipc.openai import ChatCompletionRequest, CompletionRequest, ErrorResponse
from sluice import __version__

_OPERATIONS = {
    "/v1/chat/completions": ("createChatCompletion", ChatCompletionRequest),
    "/v1/completions": ("createCompletion", CompletionRequest),
}


def openapi_document() -> dict:
    (*_, error), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ErrorResponse], ref_template="#/components/schemas/{name}")
    errors = {str(code): {"description": why, "content": {"application/json": {"schema": error}}}
              for code, why in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                                (413, "body too large"), (503, "shutting down or at capacity"),
                                (504, "past the request deadline"))}
    paths = {
        path: {"post": {
            "operationId": op,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}}},
            "responses": {"200": {"description": "the completion (JSON, or SSE when stream is true)"}, **errors},
        }}
        for path, (op, cls) in _OPERATIONS.items()
    }
    paths["/v1/models"] = {"get": {"operationId": "listModels", "responses": {"200": {"description": "models"}}}}
    return {"openapi": "3.1.0", "info": {"title": "Sluice", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}
