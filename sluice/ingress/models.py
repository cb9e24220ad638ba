"""GET /v1/models/{model}: one served model's card (an id may hold '/', as a hub id does)."""
from __future__ import annotations

from typing import Any

from sluice.ingress.http import respond, respond_error
from sluice.ingress.routes import Request, route


@route("GET", "/v1/models/{model:path}")
async def retrieve_model(ingress: Any, request: Request, receive, send) -> int:
    model = request.params["model"]
    if (card := ingress.models.get(model)) is None:
        return await respond_error(send, 404, f"The model {model!r} does not exist", param="model",
                                   code="model_not_found")
    return await respond(send, 200, card)
