"""Disaggregated serving, where the server meets the orchestrator: who may send disaggregated_params (the
shared secret), which role takes which request type, and the ports a context or generation worker
advertises. The KV hand-off itself is the engine's (engine/kv_transfer.py)."""
from __future__ import annotations

import hmac
import socket

import msgspec
import zmq

from sluice.base.config import ServerConfig
from sluice.ipc.messages import Failure
from sluice.schemas.openai import DisaggregatedParams

SECRET_HEADER = b"x-sluice-disagg-secret"
# disaggregated_params for a dialect whose body has no such field (Anthropic messages): JSON, same shape
PARAMS_HEADER = b"x-sluice-disaggregated-params"
ACCEPTS = {"context": "context_only", "generation": "generation_only"}  # role -> the request type it takes
_params = msgspec.json.Decoder(DisaggregatedParams)


def accepted(request, headers: list[tuple[bytes, bytes]], cfg: ServerConfig) -> DisaggregatedParams | None | Failure:
    """The request's disaggregated_params if this server takes them (None: it has none), or why not."""
    params = params_of(request, headers)
    if params is None or isinstance(params, Failure):
        return params
    return refusal(params, headers, cfg) or params


def params_of(request, headers: list[tuple[bytes, bytes]]) -> DisaggregatedParams | None | Failure:
    """The request's disaggregated_params (its body's field, or the header), None without; a Failure when the
    header is not valid."""
    params = getattr(request, "disaggregated_params", None)
    if params is not None:
        return params
    raw = next((v for k, v in headers if k.lower() == PARAMS_HEADER), None)
    if raw is None:
        return None
    try:
        return _params.decode(raw)
    except msgspec.MsgspecError as e:
        return Failure(400, f"invalid {PARAMS_HEADER.decode()} header: {e}", param="disaggregated_params")


def refusal(params: DisaggregatedParams, headers: list[tuple[bytes, bytes]], cfg: ServerConfig) -> Failure | None:
    """Why this server does not take the disaggregated request, if it does not."""
    given = next((v for k, v in headers if k.lower() == SECRET_HEADER), b"")
    if not cfg.disagg_secret or not hmac.compare_digest(given, cfg.disagg_secret.encode()):
        return Failure(403, "disaggregated_params are accepted only from this server's orchestrator",
                       "forbidden", "disaggregated_params")
    if ACCEPTS.get(cfg.role) != params.request_type:
        return Failure(400, f"this server's role is {cfg.role}: it does not take {params.request_type} requests",
                       param="disaggregated_params.request_type")
    if params.request_type == "generation_only" and (
            params.opaque_state is None or not params.first_gen_tokens or params.prompt_token_ids_b64 is None):
        return Failure(400, "a generation_only request needs opaque_state, first_gen_tokens and "
                       "prompt_token_ids_b64 (a context worker's answer)", param="disaggregated_params")
    return None


def check_role(cfg: ServerConfig) -> None:
    """ValueError where the role lacks what it needs."""
    if cfg.role != "both" and not cfg.disagg_secret:
        raise ValueError(f"--role {cfg.role} needs --disagg-secret: the orchestrator proves itself with it")


def endpoint(cfg: ServerConfig, port: int, *, bind: bool = False) -> str:
    """tcp://HOST:PORT of one of this server's KV ports: where it binds (port 0: one the bind picks, so no
    other process can take it between a pick and the bind), or where others reach it."""
    host = cfg.host if bind else (cfg.advertise_host or _reachable(cfg.host))
    return f"tcp://{f'[{host}]' if ':' in host else host}:{'*' if bind and not port else port}"


def bound_port(sock: zmq.Socket) -> int:
    """The TCP port a ZeroMQ socket bound last (0 where it is not bound over TCP)."""
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(bound.rsplit(":", 1)[1]) if bound.startswith("tcp://") else 0


def _reachable(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host
