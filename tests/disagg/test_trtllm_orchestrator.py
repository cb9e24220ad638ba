"""TensorRT-LLM's `trtllm-serve disaggregated` orchestrator drives Sluice's workers: its requests are built here as
its code builds them (tensorrt_llm/serve/openai_disagg_service.py, context first: _get_ctx_request, the context
worker's answer checked by _verify_ctx_response and _need_gen, then _get_gen_request; each body as
`model_dump(exclude_unset=True)` sends it, signed as tensorrt_llm/serve/disagg_auth.py signs it: the context_only
request unsigned, as it carries no state), and the answer has the tokens one aggregated server gives. The trio's
context worker takes unsigned context_only requests (--disagg-unsigned-context) and seals the state it answers."""
from __future__ import annotations

import hashlib
import hmac
import json
import random

import httpx
import pytest

from sluice.base.config import ServerConfig
from sluice.base.disagg import accepted, seal_state
from sluice.ipc.messages import Failure
from sluice.schemas.openai import ChatCompletionRequest, DisaggregatedParams
from tests.disagg.helpers import SECRET, comparable

MODEL = "builtin:tiny-chat"
# What TensorRT-LLM's pydantic models (extra="forbid") take of a context worker's answer: a key past these fails
# the orchestrator's parse of it.
TRT_PARAMS = {"request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
              "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint",
              "schedule_style", "ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking"}
TRT_RESPONSE = {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_token_ids_b64"}
TRT_CHAT_CHOICE = {"index", "message", "logprobs", "finish_reason", "stop_reason", "mm_embedding_handle",
                   "disaggregated_params", "avg_decoded_tokens_per_iter"}
TRT_COMPLETION_CHOICE = {"index", "text", "token_ids", "logprobs", "context_logits", "finish_reason", "stop_reason",
                         "disaggregated_params", "avg_decoded_tokens_per_iter"}
TRT_USAGE = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}

# A client's requests as the orchestrator holds them (chat's max_tokens is dumped under its field name,
# max_completion_tokens)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river and the sea. " * 6}],
        "max_completion_tokens": 24}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog " * 5, "max_tokens": 24}


def _signed(params: dict) -> dict[str, str]:
    """build_internal_disagg_auth_headers: only a request that carries state (encoded_opaque_state or
    ctx_info_endpoint) is signed."""
    if params.get("encoded_opaque_state") is None and params.get("ctx_info_endpoint") is None:
        return {}
    payload = json.dumps({"ctx_info_endpoint": params.get("ctx_info_endpoint"),
                          "encoded_opaque_state": params.get("encoded_opaque_state")},
                         sort_keys=True, separators=(",", ":")).encode()
    return {"x-trtllm-disagg-auth": "sha256=" + hmac.new(SECRET.encode(), payload, hashlib.sha256).hexdigest()}


def _orchestrate(ctx_url: str, gen_url: str, path: str, request: dict) -> httpx.Response:
    disagg_request_id = random.getrandbits(62)
    ctx_request = {**request, "disaggregated_params": {"request_type": "context_only",
                                                       "disagg_request_id": disagg_request_id},
                   "stream": False, "stream_options": None}
    r = httpx.post(ctx_url + path, json=ctx_request, headers=_signed(ctx_request["disaggregated_params"]), timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice_fields = TRT_COMPLETION_CHOICE if path == "/v1/completions" else TRT_CHAT_CHOICE
    assert set(answer) <= TRT_RESPONSE and set(answer["usage"]) <= TRT_USAGE
    assert len(answer["choices"]) == 1 and set(answer["choices"][0]) <= choice_fields
    params = answer["choices"][0]["disaggregated_params"]
    assert set(params) <= TRT_PARAMS
    assert params["ctx_request_id"] is not None and params["disagg_request_id"] == disagg_request_id
    assert params["encoded_opaque_state"].startswith("v1.")  # (sealed: it was asked for unsigned)
    assert answer["choices"][0]["finish_reason"] in ("length", "not_finished")  # (else no generation request)
    gen_request = dict(request)
    gen_request["disaggregated_params"] = {**params, "request_type": "generation_only",
                                           "disagg_request_id": disagg_request_id}
    if path == "/v1/completions":
        gen_request["prompt"] = answer["prompt_token_ids"]
    else:
        gen_request["prompt_token_ids"] = answer["prompt_token_ids"]
    return httpx.post(gen_url + path, json=gen_request, headers=_signed(gen_request["disaggregated_params"]),
                      timeout=60)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11, "n": 2},
                                      {"temperature": 0, "stream": True}], ids=["greedy", "seeded-n2", "stream"])
def test_trtllm_orchestrators_requests_give_the_aggregated_servers_tokens(trio, path, body, sampling):
    req = {**body, **sampling, "return_token_ids": True}
    stream = bool(sampling.get("stream"))
    want = comparable(httpx.post(trio.agg.url + path, json=req, timeout=60), stream)
    assert comparable(_orchestrate(trio.ctx.url, trio.gen.url, path, req), stream) == want


def test_a_generation_request_signed_for_another_state_is_refused(trio):
    ctx_request = {**CHAT, "disaggregated_params": {"request_type": "context_only"}}
    r = httpx.post(trio.ctx.url + "/v1/chat/completions", json=ctx_request, timeout=60)
    params = {**r.json()["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    forged = {**params, "encoded_opaque_state": params["encoded_opaque_state"][:-4] + "AAA="}
    r = httpx.post(trio.gen.url + "/v1/chat/completions", json={**CHAT, "disaggregated_params": forged},
                   headers=_signed(params), timeout=30)
    assert r.status_code == 403 and r.json()["error"]["param"] == "disaggregated_params", r.text
    r = httpx.post(trio.gen.url + "/v1/chat/completions", json={**CHAT, "disaggregated_params": params}, timeout=30)
    assert r.status_code == 403, r.text  # (the state, unsigned)
    r = httpx.post(trio.gen.url + "/v1/chat/completions", json={**CHAT, "disaggregated_params": params},
                   headers=_signed(params), timeout=30)
    assert r.status_code == 200, r.text  # (the lease read, and released)


def _cfg(**kw) -> ServerConfig:
    return ServerConfig(model="m", model_path="/nonexistent", disagg_secret=SECRET, **kw)


def _request(**params) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[], disaggregated_params=DisaggregatedParams(**params))


@pytest.mark.parametrize("headers", [[], [(b"x-trtllm-disagg-auth", b"sha256=00")],
                                     [(b"x-sluice-disagg-secret", b"guess")]], ids=["unsigned", "forged", "guessed"])
def test_only_a_context_worker_told_to_takes_unsigned_context_requests_and_never_a_failed_proof(headers):
    context_only = _request(request_type="context_only", disagg_request_id=7)
    taken = accepted(context_only, headers, _cfg(role="context", disagg_unsigned_context=True))
    assert isinstance(taken, DisaggregatedParams) if not headers else taken.status == 403, taken
    for cfg in (_cfg(role="context"), _cfg(role="generation", disagg_unsigned_context=True),
                _cfg(disagg_unsigned_context=True)):
        assert accepted(context_only, headers, cfg).status == 403  # (off by default; a context worker's only)
    with_state = _request(request_type="context_only", encoded_opaque_state="eA==")  # (signed, by TensorRT-LLM)
    assert accepted(with_state, headers, _cfg(role="context", disagg_unsigned_context=True)).status == 403


def test_a_sealed_state_opens_only_under_its_secret_and_only_signed():
    state = "c3RhdGU="
    sealed = seal_state(SECRET, state)
    assert sealed.startswith("v1.") and state not in sealed and seal_state(SECRET, state) != sealed
    gen = _cfg(role="generation")
    params = dict(request_type="generation_only", first_gen_tokens=[5], encoded_opaque_state=sealed)
    signed = [(b"x-trtllm-disagg-auth", _signed(params)["x-trtllm-disagg-auth"].encode())]
    opened = accepted(_request(**params), signed, gen)
    assert isinstance(opened, DisaggregatedParams) and opened.encoded_opaque_state == state
    assert accepted(_request(**params), [], gen).status == 403
    other = {**params, "encoded_opaque_state": seal_state("another secret", state)}
    refused = accepted(_request(**other), [(b"x-sluice-disagg-secret", SECRET.encode())], gen)
    assert isinstance(refused, Failure) and refused.status == 400 and "sealed" in refused.message
