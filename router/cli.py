"""`sluice router`: parse the flags, then become granian serving the router app."""
from __future__ import annotations

import os
import sys

import msgspec

from router.config import parse


def main(argv: list[str]) -> None:
    cfg = parse(argv)
    cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--workers", str(cfg.router_workers),
           "--loop", "uvloop", "--host", cfg.host, "--port", str(cfg.port), "--no-ws", "--http", "1",
           "--log-level", "warning", "router.app:create_app"]
    env = dict(os.environ, SLUICE_ROUTER_CONFIG=msgspec.json.encode(cfg).decode())
    os.execvpe(cmd[0], cmd, env)
