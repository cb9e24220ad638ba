"""`sluice serve --grpc`: the SGLang model gateway (pypi sglang-router 0.3.2, `--worker-urls grpc://...`) drives
Sluice over its worker protocol and gets the greedy tokens Sluice's own HTTP API gives, its structured output,
and aborts when its client leaves; a gRPC client of the protocol checks health, model info, logprobs, stop
tokens, aborts, refusals and a restarted door directly."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import httpx
import pytest

from bench.server import Server, free_port
from sluice.base.harmony_vocab import ensure_vocab
from sluice.ingress.grpc import sglang_scheduler_pb2 as pb

MODEL = "builtin:tiny-chat"
SERVICE = "/sglang.grpc.scheduler.SglangScheduler/"
LONG = 4000  # tokens: seconds of the tiny model's decoding, so an abort that works is seen to cut it short


@pytest.fixture(scope="module")
def door():
    """A server with the gRPC door, and the door's port (from its log)."""
    s = Server("--grpc", "0", "--postproc-workers", "1", "--render-workers", "1", "--ingress-workers", "1")
    m = re.search(r"gRPC \(.*\) on \S+:(\d+)", s.output())
    assert m, s.output()
    yield s, int(m.group(1))
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def stub(door):
    channel = grpc.insecure_channel(f"127.0.0.1:{door[1]}")
    yield Stub(channel)
    channel.close()


class Stub:
    """The protocol's four methods, from the messages' own codecs."""

    def __init__(self, channel: grpc.Channel) -> None:
        def unary(name, req, resp):
            return channel.unary_unary(SERVICE + name, request_serializer=req.SerializeToString,
                                       response_deserializer=resp.FromString)
        self.health = unary("HealthCheck", pb.HealthCheckRequest, pb.HealthCheckResponse)
        self.abort = unary("Abort", pb.AbortRequest, pb.AbortResponse)
        self.model_info = unary("GetModelInfo", pb.GetModelInfoRequest, pb.GetModelInfoResponse)
        self.generate = channel.unary_stream(SERVICE + "Generate",
                                             request_serializer=pb.GenerateRequest.SerializeToString,
                                             response_deserializer=pb.GenerateResponse.FromString)


def _request(rid: str, ids: list[int], max_new_tokens: int, stream: bool = True, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(temperature=0, top_p=1, top_k=-1,
                                                                max_new_tokens=max_new_tokens, **sampling))


def _running(server: Server) -> float:
    return server.metrics()["sluice:num_requests_running"]


def _freed_within(server: Server, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(server)


def _sluice_chat(server: Server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---- the gateway in front ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(door, tiny_chat_dir):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2: the test extra has it)")
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log", delete=False)
    # The gateway's gRPC mode loads harmony's vocabulary at start (it would download it): Sluice's own copy.
    env = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": ensure_vocab()}
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--worker-urls", f"grpc://127.0.0.1:{door[1]}", "--tokenizer-path",
                             str(tiny_chat_dir), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(free_port()), "--health-check-interval-secs", "1", "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _router_ready(url):
            assert proc.poll() is None, f"the router exited (code {proc.returncode}):\n{open(log.name).read()}"
            assert time.monotonic() < deadline, f"the router had no healthy worker in 60s:\n{open(log.name).read()}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _router_ready(url: str) -> bool:
    try:
        workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(w["is_healthy"] and w["connection_mode"] == "gRPC" and w["model_id"] == MODEL for w in workers)


def test_the_gateway_in_grpc_mode_gets_sluices_own_greedy_tokens(door, router):
    server = door[0]
    body = {"messages": [{"role": "user", "content": "Tell me a story about a cat"}], "temperature": 0,
            "max_tokens": 24}
    own = _sluice_chat(server, **body, return_token_ids=True)
    prompt_ids, token_ids = own["prompt_token_ids"], own["choices"][0]["token_ids"]
    # The gateway renders the chat template and tokenizes: the same prompt, the same tokens back.
    r = httpx.post(router + "/v1/chat/completions", timeout=60, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    via = r.json()
    assert via["usage"]["prompt_tokens"] == len(prompt_ids)
    assert via["usage"]["completion_tokens"] == len(token_ids)
    assert via["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"] == "length"
    # Its /generate, ids in: the very ids, and the text its chat answer had (its detokenizer's, which drops
    # the bytes of an unfinished character where Sluice's shows U+FFFD: the text is compared with its own).
    r = httpx.post(router + "/generate", timeout=60, json={"model": MODEL, "input_ids": prompt_ids,
                                                          "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == token_ids
    text = via["choices"][0]["message"]["content"]
    assert text == r.json()[0]["text"]
    # Streamed: the same text, chunk by chunk.
    streamed, finish = "", None
    with httpx.stream("POST", router + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, **body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                streamed += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    assert (streamed, finish) == (text, "length")


def test_the_gateways_structured_output_is_held_to_its_schema(router):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = httpx.post(router + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
    assert choice["finish_reason"] == "stop"


def test_a_client_that_leaves_the_gateway_is_aborted_in_sluice(door, router):
    server = door[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router + "/v1/chat/completions", timeout=60, json=body) as s:
        for n, line in enumerate(s.iter_lines()):
            if n == 40:  # (leaving the loop closes the response: assert before)
                assert _running(server) == 1
                break
    assert _freed_within(server, 3.0)


# ---- the protocol directly -----------------------------------------------------------------------------


def test_health_and_model_info(stub, tiny_chat_dir):
    health = stub.health(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy and health.message == "ok"
    info = stub.model_info(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == MODEL and info.is_generation
    assert info.max_context_length == 4096 and info.vocab_size > 0 and list(info.eos_token_ids)
    assert info.tokenizer_path == str(tiny_chat_dir)


def test_a_whole_output_and_a_stop_token(stub, door):
    own = _sluice_chat(door[0], messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=8,
                       return_token_ids=True)
    prompt, tokens = own["prompt_token_ids"], own["choices"][0]["token_ids"]
    [whole] = list(stub.generate(_request("whole", prompt, 8, stream=False), timeout=60))
    assert whole.request_id == "whole" and whole.WhichOneof("response") == "complete"
    assert list(whole.complete.output_ids) == tokens
    assert (whole.complete.finish_reason, whole.complete.prompt_tokens, whole.complete.completion_tokens) == \
        ("length", len(prompt), 8)
    # The sampled tokens' logprobs, as the HTTP API gives them.
    own = _sluice_chat(door[0], messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=8,
                       logprobs=True, top_logprobs=2)
    [scored] = list(stub.generate(pb.GenerateRequest(request_id="scored", tokenized=pb.TokenizedInput(input_ids=prompt),
                                                     sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=8),
                                                     return_logprob=True, top_logprobs_num=2), timeout=60))
    lps = scored.complete.output_logprobs
    assert list(lps.token_ids) == tokens and [len(t.values) for t in lps.top_logprobs] == [2] * 8
    assert list(lps.token_logprobs) == pytest.approx([c["logprob"] for c in own["choices"][0]["logprobs"]["content"]],
                                                     abs=1e-4)
    # A stop token ends the output without being part of it; the router is told which one it was.
    stop = tokens[3]
    first = tokens.index(stop)
    [stopped] = list(stub.generate(_request("stopped", prompt, 8, stream=False, stop_token_ids=[stop]), timeout=60))
    assert list(stopped.complete.output_ids) == tokens[:first]
    assert stopped.complete.finish_reason == "stop" and stopped.complete.matched_token_id == stop
    assert stopped.complete.completion_tokens == first + 1


def test_an_abort_ends_the_stream_and_frees_the_engine(stub, door):
    responses = stub.generate(_request("to-abort", [1, 2, 3], LONG, ignore_eos=True), timeout=60)
    first = next(responses)
    assert first.WhichOneof("response") == "chunk" and first.chunk.token_ids
    assert stub.abort(pb.AbortRequest(request_id="to-abort"), timeout=10).success
    rest = list(responses)
    assert rest[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in [first, *rest]) < LONG
    assert _freed_within(door[0], 3.0)
    assert not stub.abort(pb.AbortRequest(request_id="to-abort"), timeout=10).success  # (no longer in flight)


def test_a_cancelled_call_is_aborted_in_the_engine(stub, door):
    responses = stub.generate(_request("to-cancel", [1, 2, 3], LONG, ignore_eos=True), timeout=60)
    next(responses)
    assert _running(door[0]) == 1
    responses.cancel()
    assert _freed_within(door[0], 3.0)


def test_what_the_door_refuses(stub):
    def code(request: pb.GenerateRequest) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.generate(request, timeout=30))
        return e.value.code()

    tag = _request("tag", [1, 2, 3], 4)
    tag.sampling_params.structural_tag = "{}"
    assert code(tag) == grpc.StatusCode.UNIMPLEMENTED
    bad_regex = _request("bad-regex", [1, 2, 3], 4)
    bad_regex.sampling_params.regex = "(unclosed"
    assert code(bad_regex) == grpc.StatusCode.INVALID_ARGUMENT
    assert code(_request("past-vocab", [1, 10 ** 6], 4)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code(_request("too-long", [1, 2, 3], 5000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code(_request("empty", [], 4)) == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_streams_each_get_their_own_tokens(stub):
    whole = {i: list(list(stub.generate(_request(f"alone-{i}", [1, 2 + i], 16, stream=False), timeout=60))[0]
                     .complete.output_ids) for i in range(3)}
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = [t for r in stub.generate(_request(f"together-{i}", [1, 2 + i], 16), timeout=60)
                  for t in r.chunk.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == whole


def test_a_door_that_dies_is_restarted_and_its_requests_freed(stub, door):
    """(Last: it kills the module's door process.)"""
    server, port = door
    pids = lambda: [int(p) for p in re.findall(r"grpc\[0\] ready \(pid (\d+)\)", server.output())]  # noqa: E731
    [pid] = pids()
    responses = stub.generate(_request("orphan", [1, 2, 3], LONG, ignore_eos=True), timeout=60)
    next(responses)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError):
        list(responses)
    assert _freed_within(server, 3.0)  # the postproc shard dropped it, the engine aborted it
    deadline = time.monotonic() + 60
    while len(pids()) < 2:
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.2)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        again = Stub(channel)
        assert again.health(pb.HealthCheckRequest(), timeout=10).healthy
        [whole] = list(again.generate(_request("after", [1, 2, 3], 4, stream=False), timeout=60))
        assert len(whole.complete.output_ids) == 4
    finally:
        channel.close()
