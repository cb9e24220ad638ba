"""`sluice router`'s configuration: one frozen Struct, from flags (each defined once, here)."""
from __future__ import annotations

import argparse
from typing import Literal

import msgspec

from sluice.base import envs


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    workers: list[str] = []  # replicas
    context: list[str] = []  # context workers (disaggregated serving)
    generation: list[str] = []  # generation workers
    host: str = "127.0.0.1"
    port: int = 8100
    model: str | None = None  # the checkpoint the workers serve (prompts are hashed with its tokenizer)
    policy: Literal["kv", "round_robin"] = "kv"
    overlap_weight: float = 1.0
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    max_local_prefill: int = 128
    disagg_secret: str | None = None
    health_interval: float = 1.0
    health_failures: int = 2
    request_timeout: float = 600.0
    max_request_bytes: int = 32 << 20
    router_workers: int = 1
    api_keys: list[str] = []  # what the router's own clients must send
    protect_metrics: bool = False
    worker_api_key: str | None = None  # what the router sends the workers (None: the client's own key, relayed)

    @property
    def disaggregated(self) -> bool:
        return bool(self.context or self.generation)


_FLAGS: list[tuple[str, dict]] = [
    ("--workers", dict(nargs="+", default=[], metavar="URL", help="replica servers (KV-aware routing over them)")),
    ("--context", dict(nargs="+", default=[], metavar="URL", help="context workers (sluice serve --role context)")),
    ("--generation", dict(nargs="+", default=[], metavar="URL",
                          help="generation workers (sluice serve --role generation)")),
    ("--host", dict(default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")),
    ("--port", dict(type=int, default=8100, help="port to listen on (default: 8100)")),
    ("--model", dict(help="the workers' checkpoint (builtin:NAME, a directory or a hub id): its tokenizer hashes "
                          "prompts (default: the first worker's model directory, when it is on this host)")),
    ("--policy", dict(choices=["kv", "round_robin"], default="kv",
                      help="kv: cached prefix against load; round_robin: in turn (default: kv)")),
    ("--overlap-weight", dict(type=float, default=1.0,
                              help="cost of a prompt block a worker must compute, against one it holds busy "
                                   "(default: 1.0)")),
    ("--balance-abs-threshold", dict(type=int, default=16,
                                     help="in-flight requests between the busiest and idlest worker past which "
                                          "(with --balance-rel-threshold) load alone decides (default: 16)")),
    ("--balance-rel-threshold", dict(type=float, default=1.5, help="(default: 1.5)")),
    ("--max-local-prefill", dict(type=int, default=128,
                                 help="a prompt whose part not cached on the generation worker is this many tokens "
                                      "or fewer is computed there, without a context worker (default: 128)")),
    ("--disagg-secret", dict(help="the workers' --disagg-secret (required with --context/--generation)")),
    ("--health-interval", dict(type=float, default=1.0, help="seconds between health checks (default: 1)")),
    ("--health-failures", dict(type=int, default=2,
                               help="failed checks in a row that take a worker out (default: 2)")),
    ("--request-timeout", dict(type=float, default=600.0,
                               help="seconds a worker may stay silent on a relayed request (no byte of its answer; a "
                                    "stream that keeps coming is not cut) before the router gives up (default: 600)")),
    ("--router-workers", dict(type=int, default=1, help="HTTP worker processes (default: 1)")),
    ("--api-key", dict(dest="api_keys", action="append", default=[], metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key') of the router's clients on /v1 "
                            "routes (repeatable; also SLUICE_API_KEY, comma-separated)")),
    ("--protect-metrics", dict(action="store_true", help="require the API key on /metrics and the health routes too")),
    ("--worker-api-key", dict(metavar="KEY",
                              help="the key the router sends the workers on every call (health, models, requests); "
                                   "also SLUICE_WORKER_API_KEY (default: each client's own key, relayed)")),
]


def parse(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="sluice router", description="KV-cache-aware router over Sluice servers")
    for flag, kw in _FLAGS:
        parser.add_argument(flag, **kw)
    args = vars(parser.parse_args(argv))
    args["disagg_secret"] = args.get("disagg_secret") or envs.disagg_secret()
    args["api_keys"] = args["api_keys"] + envs.api_keys()
    args["worker_api_key"] = args.get("worker_api_key") or envs.worker_api_key()
    cfg = msgspec.convert(args, RouterConfig)
    if not cfg.workers and not (cfg.context and cfg.generation):
        parser.error("give --workers URL..., or --context URL... and --generation URL...")
    if cfg.workers and cfg.disaggregated:
        parser.error("--workers routes over replicas; --context/--generation disaggregate: not both")
    if cfg.disaggregated and not cfg.disagg_secret:
        parser.error("--context/--generation need --disagg-secret (the workers' own)")
    return cfg
