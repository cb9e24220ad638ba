"""The OpenAPI document, generated from the same msgspec Structs that validate requests."""
from __future__ import annotations

from typing import Any

import msgspec

from ipc.openai import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest
from sluice import __version__

_OPERATIONS = {
    "/v1/chat/completions": ("createChatCompletion", ChatCompletionRequest),
    "/v1/completions": ("createCompletion", CompletionRequest),
    "/tokenize": ("tokenize", TokenizeRequest),
    "/detokenize": ("detokenize", DetokenizeRequest),
}


def openapi_document() -> dict:
    (*_, error), components = msgspec.json.schema_components(
        [*(cls for _, cls in _OPERATIONS.values()), ErrorResponse], ref_template="#/components/schemas/{name}")
    errors = {str(code): {"description": why, "content": {"application/json": {"schema": error}}}
              for code, why in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                                (413, "body too large"), (503, "shutting down or at capacity"),
                                (504, "past the request deadline"))}
    paths: dict[str, Any] = {
        path: {"post": {
            "operationId": op,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}}},
            "responses": {"200": {"description": "the completion (JSON, or SSE when stream is true)"}, **errors},
        }}
        for path, (op, cls) in _OPERATIONS.items()
    }
    paths["/v1/models"] = {"get": {"operationId": "listModels", "responses": {"200": {"description": "models"}}}}
    paths["/v1/models/{model}"] = {"get": {
        "operationId": "retrieveModel",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model"}, "404": {"description": "no such model here"}}}}
    return {"openapi": "3.1.0", "info": {"title": "Sluice", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}
