"""The router's one use of the chat core: a request's prompt ids and cache salt, rendered as a worker's
render pool does, to hash its blocks as the engines do. Nothing rendered here goes to a worker."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import msgspec

from sluice.ipc.messages import RenderJob
from sluice.schemas.responses import CreateResponse, RenderBody

log = logging.getLogger("sluice.router")
_responses = msgspec.json.Decoder(CreateResponse)


class Prompts:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self.core: Any = None  # render.core.ChatCore, built once the model is known

    def start(self, roots: list[str | None]) -> None:
        """Loads the tokenizer and chat template: --model's, else the first worker's model directory."""
        if self.core is not None:
            return
        from sluice.app.builtin_models import resolve_model
        from sluice.base.options import validated
        from sluice.render.worker import build_core

        try:
            path = str(resolve_model(self.model)) if self.model else next(r for r in roots if r and os.path.isdir(r))
        except (StopIteration, ValueError, OSError) as e:
            log.warning("no model to hash prompts with (%s): routing by load alone; give --model", e)
            return
        hf = json.loads(open(os.path.join(path, "config.json")).read())
        cfg = msgspec.structs.replace(validated({"model": self.model or path}), model_path=path,
                                      max_model_len=hf.get("max_position_embeddings") or 4096)
        self.core = build_core(cfg)

    async def ids(self, endpoint: str, body: bytes) -> tuple[list[int] | None, str]:
        """(prompt ids, cache salt); None when the router cannot render it (the worker will say why)."""
        if self.core is None:
            return None, ""
        return await asyncio.to_thread(self._render, endpoint, body)

    def _render(self, endpoint: str, body: bytes) -> tuple[list[int] | None, str]:
        try:
            if endpoint == "responses":
                request = _responses.decode(body)
                if request.previous_response_id is not None:  # its conversation is stored on a worker
                    return None, ""
                body = msgspec.json.encode(RenderBody(request))
            return self.core.prompt(RenderJob("router", endpoint, body, "", time.time()))  # type: ignore[arg-type]
        except Exception:  # any request the chat core refuses: the worker answers it
            return None, ""
