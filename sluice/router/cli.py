"""`sluice router`: parse the flags, hold the port, then become granian serving the router app."""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

import msgspec

from sluice.base import ports
from sluice.router.config import parse


def main(argv: list[str]) -> None:
    cfg = parse(argv)
    for url in (*cfg.workers, *cfg.context, *cfg.generation):
        if refused := _refuses_the_key(url, cfg.worker_api_key):
            sys.exit(f"sluice router: {url} answers {refused} to the router's key: give the router the workers' key "
                     f"(--worker-api-key or SLUICE_WORKER_API_KEY)")
    try:
        http = ports.hold(cfg.host, cfg.port)  # held by granian's main process once exec'd (see sluice.ports)
    except OSError as e:
        sys.exit(f"sluice router: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}")
    http.set_inheritable(True)
    cfg = msgspec.structs.replace(cfg, port=http.getsockname()[1])
    print(f"sluice router: serving on http://{cfg.host}:{cfg.port}", flush=True)
    cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--workers", str(cfg.router_workers),
           "--loop", "uvloop", "--host", cfg.host, "--port", str(cfg.port), "--no-ws", "--http", "1",
           "--log-level", "warning", "sluice.router.app:create_app"]
    env = dict(os.environ, SLUICE_ROUTER_CONFIG=msgspec.json.encode(cfg).decode())
    os.execvpe(cmd[0], cmd, env)


def _refuses_the_key(url: str, key: str | None) -> int | None:
    """401 or 403 where the worker refuses the key (or its absence) on /health or /v1/models; None where it
    accepts it, or cannot be reached now (a worker may start after its router: its health checks follow)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for path in ("/health", "/v1/models"):
        try:
            urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + path, headers=headers), timeout=5)
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                return e.code
        except (OSError, ValueError):
            return None
    return None
