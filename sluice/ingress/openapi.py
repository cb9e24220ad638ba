"""The OpenAPI document: every route the ingress serves (the dialects' generation routes, the registered ones,
the fixed ones), with request bodies from the same msgspec Structs that validate them. operationIds are
trtllm-serve's where it serves the route (FastAPI's: handler name, path, method), and made the same way from
the handler's name elsewhere, so a client generated from either document keeps its method names."""
from __future__ import annotations

import re
from typing import Any

import msgspec

import sluice.ingress.anthropic  # noqa: F401  (each registers its routes)
import sluice.ingress.models  # noqa: F401
import sluice.ingress.responses
import sluice.ingress.stored_chat
import sluice.ingress.tokenize  # noqa: F401
import sluice.ingress.worker_info  # noqa: F401
from sluice import __version__
from sluice.ingress.dialects import DIALECTS
from sluice.ingress.routes import ROUTES
from sluice.schemas import anthropic, openai

FIXED = {"/v1/models": "the served models", "/health": "200 when every stage answers",
         "/ready": "200 when the server takes requests", "/health_generate": "one token through every stage",
         "/version": "the server's version", "/metrics": "Prometheus metrics",
         "/prometheus/metrics": "Prometheus metrics (trtllm-serve's path)", "/openapi.json": "this document"}
# trtllm-serve's operationIds (FastAPI's: its handler's name, the path, the method)
TRTLLM_IDS = {("post", "/v1/chat/completions"): "openai_chat_v1_chat_completions_post",
              ("post", "/v1/completions"): "openai_completion_v1_completions_post",
              ("post", "/v1/responses"): "openai_responses_v1_responses_post",
              ("get", "/v1/models"): "get_model_v1_models_get", ("get", "/health"): "health_health_get",
              ("get", "/health_generate"): "health_generate_health_generate_get",
              ("get", "/version"): "version_version_get"}
# the bodies of the routes that take one, beyond the dialects' generation routes
BODIES: dict[tuple[str, str], type] = {
    ("post", "/v1/responses"): sluice.ingress.responses.RESPONSES.request_type,
    ("post", "/v1/messages/count_tokens"): anthropic.CountTokensRequest,
    ("post", "/v1/messages/batches"): anthropic.BatchCreateRequest,
    ("post", "/tokenize"): openai.TokenizeRequest, ("post", "/detokenize"): openai.DetokenizeRequest,
    ("post", "/v1/chat/completions/{id}"): sluice.ingress.stored_chat._UPDATE.request_type,
}
_ERRORS = ((400, "invalid request"), (401, "missing or wrong API key"), (404, "not found"), (413, "body too large"),
           (503, "shutting down or at capacity"), (504, "past the request deadline"))
_REF = "#/components/schemas/{name}"


def openapi_document() -> dict:
    operations = _operations()
    bodies = sorted({cls for *_, cls in operations if cls is not None}, key=lambda c: c.__name__)
    (*schemas, openai_error, anthropic_error), components = msgspec.json.schema_components(
        [*bodies, openai.ErrorResponse, anthropic.ErrorResponse], ref_template=_REF)
    errors = {shape: {str(code): {"description": why, "content": {"application/json": {"schema": schema}}}
                      for code, why in _ERRORS}
              for shape, schema in (("openai", openai_error), ("anthropic", anthropic_error))}
    paths: dict[str, Any] = {}
    for method, template, name, cls in operations:
        path = re.sub(r"\{(\w+):path\}", r"{\1}", template)
        operation: dict[str, Any] = {
            "operationId": TRTLLM_IDS.get((method, path)) or _fastapi_id(name, path, method),
            "responses": {"200": {"description": "the answer (JSON; SSE for a generation that streams)"},
                          **errors["anthropic" if path.startswith("/v1/messages") else "openai"]}}
        params = re.findall(r"\{(\w+)\}", path)
        if params:
            operation["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for p in params]
        if cls is not None:
            operation["requestBody"] = {
                "required": True, "description": "JSON, or msgpack with the same fields (Content-Type: "
                "application/msgpack)", "content": {"application/json": {
                    "schema": {"$ref": _REF.format(name=cls.__name__)}}}}
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "Sluice", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}


def _operations() -> list[tuple[str, str, str, type | None]]:
    """(method, path template, handler name, body Struct or None) of every route served."""
    ops: list[tuple[str, str, str, type | None]] = [
        ("post", d.path, f"create_{d.endpoint}", d.request_type) for d in DIALECTS.values()]
    ops += [(r.method.lower(), r.template, r.handler.__name__, BODIES.get((r.method.lower(), r.template)))
            for r in ROUTES]
    ops += [("get", path, re.sub(r"\W", "_", path.strip("/")), None) for path in FIXED]
    return ops


def _fastapi_id(name: str, path: str, method: str) -> str:
    return re.sub(r"\W", "_", name + path) + "_" + method
