"""Disaggregated serving in the render: where a context_only request's KV goes (KvExport), and a
generation_only request's prompt, first tokens and their logprobs, and prompt logprobs, as its context worker's
opaque state holds them (KvImport): such a request is not rendered again. Also TensorRT-LLM's
prompt_token_ids_b64, how its orchestrator hands a prompt's ids on (any client may send them)."""
from __future__ import annotations

import base64
import binascii
from typing import Callable

import msgspec
import numpy as np

from sluice.ipc.kv import ContextState
from sluice.ipc.messages import KvExport, KvImport, RenderJob, bytes_to_ids, ids_to_bytes
from sluice.render.errors import RequestError
from sluice.schemas.openai import ChatCompletionRequest, CompletionRequest, DisaggregatedParams

CheckIds = Callable[[list[int], str], None]  # raises RequestError where an id is past the vocabulary
_handle_bytes = msgspec.msgpack.Encoder()


def ids_to_b64(ids: list[int]) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def ids_from_b64(text: str) -> list[int]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, "prompt_token_ids_b64 is not valid base64", param="prompt_token_ids_b64") from None
    if len(raw) % 4:
        raise RequestError(400, "prompt_token_ids_b64 must decode to little-endian int32s (a multiple of 4 bytes)",
                           param="prompt_token_ids_b64")
    return np.frombuffer(raw, dtype="<i4").tolist()


def imported_prompt(job: RenderJob, request: ChatCompletionRequest | CompletionRequest, check_ids: CheckIds,
                    decode: Callable[[list[int]], str]) -> tuple[list[int], list[int], str] | None:
    """A generation_only request's prompt ids and output prefix, as its context worker rendered them, and what
    a completion with echo starts with ("" without)."""
    state = _context_state(job.disagg)
    if state is None:
        return None
    ids = bytes_to_ids(state.prompt_token_ids).tolist()
    if not ids or state.output_prefix_len > len(ids):
        raise RequestError(400, "disaggregated_params.encoded_opaque_state holds no prompt, or one shorter than "
                           "its output prefix", param="disaggregated_params.encoded_opaque_state")
    check_ids(ids, "disaggregated_params.encoded_opaque_state")
    echo = _imported_echo(request, ids, decode) if isinstance(request, CompletionRequest) else ""
    return ids, ids[len(ids) - state.output_prefix_len:], echo


def _imported_echo(request: CompletionRequest, ids: list[int], decode: Callable[[list[int]], str]) -> str:
    """What a completion with echo starts with, for a prompt its context worker tokenized."""
    if not request.echo:
        return ""
    prompt = request.prompt[0] if isinstance(request.prompt, list) and len(request.prompt) == 1 else request.prompt
    return prompt if isinstance(prompt, str) and prompt else decode(ids)


def kv_of(job: RenderJob, request: ChatCompletionRequest | CompletionRequest, prefix_len: int,
          top_logprobs: int | None, check_ids: CheckIds) -> KvExport | KvImport | None:
    """Where a disaggregated request's KV goes (context_only) or comes from (generation_only)."""
    d = job.disagg
    if d is None or d.request_type == "context_and_generation":
        return None
    if d.request_type == "context_only":
        return KvExport(job.reply_to, prefix_len, request.model, job.endpoint == "completions",
                        d.disagg_request_id, d.return_prompt_token_ids_b64)
    first = d.first_gen_tokens or []
    if len(first) != request.n:
        raise RequestError(400, f"disaggregated_params.first_gen_tokens has {len(first)} tokens for "
                           f"{request.n} choices", param="disaggregated_params.first_gen_tokens")
    check_ids(first, "disaggregated_params.first_gen_tokens")
    logprobs = _first_logprobs(d, first, top_logprobs) if top_logprobs is not None else []
    state = _context_state(d)
    if state is None:  # (the engine finds no handle in it: it recomputes the prompt, or fails the request)
        return KvImport(b"", ids_to_bytes(first), first_logprobs=logprobs)
    k = request.prompt_logprobs
    prompt_logprobs = state.prompt_logprobs if k is not None else None
    if k is not None and (prompt_logprobs is None or prompt_logprobs.k != k):
        raise RequestError(400, "the context worker's answer holds no prompt_logprobs with as many alternatives as "
                           "this request asks (send the context_only request with the same prompt_logprobs)",
                           param="prompt_logprobs")
    return KvImport(_handle_bytes.encode(state.handle), ids_to_bytes(first), state.num_cached_tokens, logprobs,
                    prompt_logprobs)


def _context_state(d: DisaggregatedParams | None) -> ContextState | None:
    """A generation_only request's opaque state; None where it has none, or one no context worker of ours made
    (the prompt is rendered here then, from the request's prompt ids or messages)."""
    if d is None or d.request_type != "generation_only":
        return None
    try:
        return ContextState.decode(base64.b64decode(d.encoded_opaque_state or "", validate=True))
    except (binascii.Error, ValueError, msgspec.MsgspecError):
        return None


class _WireLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None


def _first_logprobs(d: DisaggregatedParams, first: list[int], top_logprobs: int) -> list[list[tuple[int, float, int]]]:
    """Each first token's logprobs from the context worker (TensorRT-LLM's first_gen_log_probs: per choice, the
    sampled token's {token_id, logprob, rank} then the most likely ones'), as many as the request asks."""
    param = "disaggregated_params.first_gen_log_probs"
    given = d.first_gen_log_probs or []
    if len(given) != len(first):
        raise RequestError(400, "a generation_only request that asks for logprobs needs its context worker's "
                           "first_gen_log_probs, one per choice (send the context_only request with logprobs too)",
                           param=param)
    out = []
    for token, position in zip(first, given):
        try:
            entries = msgspec.convert(position, list[_WireLogprob])
        except msgspec.ValidationError as e:
            raise RequestError(400, f"{param} is not a list of {{token_id, logprob, rank}} per choice: {e}",
                               param=param) from None
        if not entries or entries[0].token_id != token or len(entries) - 1 < top_logprobs:
            raise RequestError(400, f"{param} does not hold the first token's logprob and {top_logprobs} most "
                               "likely ones (send the context_only request with the same logprobs)", param=param)
        out.append([(e.token_id, e.logprob, e.rank or i) for i, e in enumerate(entries[:top_logprobs + 1])])
    return out
