"""Disaggregated serving, where the server meets the orchestrator: who may send disaggregated_params (the
shared secret), which role takes which request type, and the ports a context or generation worker
advertises. The KV hand-off itself is the engine's (engine/kv_transfer.py)."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
from typing import Any

import msgspec
import zmq

from sluice.base.config import ServerConfig
from sluice.base.sealing import Sealer, Unsealable
from sluice.ipc.messages import Failure
from sluice.schemas.openai import DisaggregatedParams

log = logging.getLogger("sluice.disagg")
SECRET_HEADER = b"x-sluice-disagg-secret"
# TensorRT-LLM's orchestrator's proof (tensorrt_llm/serve/disagg_auth.py): "sha256=" and the hex HMAC-SHA256, under
# the shared secret, of the compact sorted JSON of the request's ctx_info_endpoint and encoded_opaque_state
TRTLLM_AUTH_HEADER = b"x-trtllm-disagg-auth"
# disaggregated_params for a dialect whose body has no such field (Anthropic messages): JSON, same shape
PARAMS_HEADER = b"x-sluice-disaggregated-params"
ACCEPTS = {"context": "context_only", "generation": "generation_only"}  # role -> the request type it takes
_KNOWN = frozenset(DisaggregatedParams.__struct_fields__)
_params = msgspec.json.Decoder(DisaggregatedParams)
_any = msgspec.json.Decoder()


class _Envelope(msgspec.Struct):
    disaggregated_params: dict[str, Any] | None = None


_envelope = msgspec.json.Decoder(_Envelope)
_SEALED = "v1."  # (sealing.Sealer's prefix: a plain state is base64, which has no ".")


def accepted(request, headers: list[tuple[bytes, bytes]], cfg: ServerConfig,
             body: bytes = b"") -> DisaggregatedParams | None | Failure:
    """The request's disaggregated_params if this server takes them (None: it has none, or it is served whole
    here), or why not. `body`: the JSON body, where fields this worker does not know are looked for (ignored,
    with a log line: a newer orchestrator must not get a 400 from an older worker)."""
    if getattr(request, "kv_hints", None) is not None and not _from_orchestrator(None, headers, cfg):
        return Failure(403, "kv_hints are accepted only from this server's orchestrator", "forbidden", "kv_hints")
    params = params_of(request, headers)
    if params is None or isinstance(params, Failure):
        return params
    _log_unknown(request, headers, body)
    refused = refusal(params, headers, cfg)
    if refused is not None or params.request_type == "context_and_generation":
        return refused
    return _opened(params, cfg)


def params_of(request, headers: list[tuple[bytes, bytes]]) -> DisaggregatedParams | None | Failure:
    """The request's disaggregated_params (its body's field, or the header), None without; a Failure when the
    header is not valid."""
    params = getattr(request, "disaggregated_params", None)
    if params is not None:
        return params
    raw = _header(headers, PARAMS_HEADER)
    if raw is None:
        return None
    try:
        return _params.decode(raw)
    except msgspec.MsgspecError as e:
        return Failure(400, f"invalid {PARAMS_HEADER.decode()} header: {e}", param="disaggregated_params")


def refusal(params: DisaggregatedParams, headers: list[tuple[bytes, bytes]], cfg: ServerConfig) -> Failure | None:
    """Why this server does not take the disaggregated request, if it does not."""
    if not _from_orchestrator(params, headers, cfg) and not _unsigned_context(params, headers, cfg):
        return Failure(403, "disaggregated_params are accepted only from this server's orchestrator",
                       "forbidden", "disaggregated_params")
    if params.request_type == "context_and_generation":  # (the whole request, here: any role serves it)
        return None
    if ACCEPTS.get(cfg.role) != params.request_type:
        return Failure(400, f"this server's role is {cfg.role}: it does not take {params.request_type} requests",
                       param="disaggregated_params.request_type")
    if params.request_type == "generation_only" and (
            params.encoded_opaque_state is None or not params.first_gen_tokens):
        return Failure(400, "a generation_only request needs encoded_opaque_state and first_gen_tokens (a context "
                       "worker's answer)", param="disaggregated_params")
    if params.schedule_style not in (None, 0):
        return Failure(400, "only the context-first schedule style is served",
                       param="disaggregated_params.schedule_style")
    return None


def trtllm_signature(secret: str, params: DisaggregatedParams | None) -> bytes:
    """TensorRT-LLM's x-trtllm-disagg-auth value for a request with these disaggregated_params."""
    endpoint = params.ctx_info_endpoint if params is not None else None
    if isinstance(endpoint, list):  # (TensorRT-LLM signs the first of a list)
        endpoint = endpoint[0] if endpoint else None
    state = params.encoded_opaque_state if params is not None else None
    payload = json.dumps({"ctx_info_endpoint": endpoint, "encoded_opaque_state": state}, sort_keys=True,
                         separators=(",", ":")).encode()
    return b"sha256=" + hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest().encode()


def _from_orchestrator(params: DisaggregatedParams | None, headers: list[tuple[bytes, bytes]],
                       cfg: ServerConfig) -> bool:
    """Whether the request proves the orchestrator's secret: Sluice's header, or TensorRT-LLM's signature."""
    if not cfg.disagg_secret:
        return False
    given = _header(headers, SECRET_HEADER)
    if given is not None and hmac.compare_digest(given, cfg.disagg_secret.encode()):
        return True
    signed = _header(headers, TRTLLM_AUTH_HEADER)
    return signed is not None and hmac.compare_digest(signed, trtllm_signature(cfg.disagg_secret, params))


def _unsigned_context(params: DisaggregatedParams, headers: list[tuple[bytes, bytes]], cfg: ServerConfig) -> bool:
    """Whether this is a context_only request as TensorRT-LLM's orchestrator sends it, unsigned (it carries no
    state to sign), to a context worker that takes those (--disagg-unsigned-context). A request with a proof
    that fails is refused all the same: its orchestrator holds another secret."""
    return (cfg.disagg_unsigned_context and cfg.role == "context" and params.request_type == "context_only"
            and params.encoded_opaque_state is None and params.ctx_info_endpoint is None
            and _header(headers, SECRET_HEADER) is None and _header(headers, TRTLLM_AUTH_HEADER) is None)


def _state_sealer(secret: str) -> Sealer:
    """The sealer of opaque states: its key is the shared secret's, for this use only."""
    return Sealer(hmac.new(secret.encode(), b"sluice disaggregated opaque state v1", hashlib.sha256).digest())


def seal_state(secret: str, state: str) -> str:
    """A context worker's encoded_opaque_state sealed (encrypted and authenticated) under the shared secret: its
    caller learns nothing of the KV handle in it, and only a holder of the secret opens it."""
    return _state_sealer(secret).seal(state)


def _opened(params: DisaggregatedParams, cfg: ServerConfig) -> DisaggregatedParams | Failure:
    """The params with their opaque state opened, where a context worker sealed it."""
    state = params.encoded_opaque_state
    if state is None or not state.startswith(_SEALED) or params.request_type != "generation_only":
        return params
    try:
        return msgspec.structs.replace(params, encoded_opaque_state=_state_sealer(cfg.disagg_secret or "").open(state))
    except Unsealable:
        return Failure(400, "disaggregated_params.encoded_opaque_state was sealed with another secret, or altered",
                       param="disaggregated_params.encoded_opaque_state")


def _log_unknown(request, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Logs the disaggregated_params fields this worker ignores (it does not know them)."""
    try:
        raw = (_envelope.decode(body).disaggregated_params if getattr(request, "disaggregated_params", None)
               is not None else _any.decode(_header(headers, PARAMS_HEADER) or b"{}"))
    except msgspec.MsgspecError:
        return
    unknown = sorted(set(raw or {}) - _KNOWN) if isinstance(raw, dict) else []
    if unknown:
        log.info("disaggregated_params: ignoring the fields this worker does not know: %s", ", ".join(unknown))


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


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
