"""GET /v1/sluice/worker: what a router needs to know of this server (its disaggregation role, where its
prefix cache's block events are published, and how blocks are hashed)."""
from __future__ import annotations

from typing import Any

import msgspec

from sluice.base.disagg import endpoint
from sluice.ingress.http import respond
from sluice.ingress.routes import Request, route


class WorkerInfo(msgspec.Struct):
    role: str
    models: list[str]
    block_size: int
    prefix_caching: bool
    kv_events: str | None  # tcp://host:port of the ZeroMQ PUB socket (ipc/kv.py KvEvents), None: not published
    kv_transfer: str
    max_model_len: int


@route("GET", "/v1/sluice/worker")
async def worker_info(ingress: Any, request: Request, receive, send) -> int:
    cfg = ingress.cfg
    events = endpoint(cfg, cfg.kv_events_port) if cfg.kv_events and cfg.enable_prefix_caching else None
    info = WorkerInfo(cfg.role, cfg.served_model_names, cfg.block_size, cfg.enable_prefix_caching, events,
                      cfg.kv_transfer, cfg.max_model_len)
    return await respond(send, 200, msgspec.json.encode(info))
