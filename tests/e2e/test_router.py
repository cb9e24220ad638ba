"""`sluice router` in front of real servers: every dialect relayed, KV-cache-aware choices, workers taken out
and put back, and disaggregated serving through it giving the aggregated server's tokens."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import msgspec
import openai
import pytest

from bench.faults import ppid
from bench.router import RouterProc
from bench.server import Server, free_port
from sluice.app.supervisor import sweep_orphans
from sluice.ipc.shm import shm_base
from tests.disagg.helpers import SECRET, comparable, kv_used

MODEL = "builtin:tiny-chat"
PREFIX = "The history of science is the story of people asking questions and testing answers. " * 10


def _counter(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? ([0-9.e+-]+)$" if want else \
        rf"^{re.escape(name)} ([0-9.e+-]+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def _chat(url: str, content: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw})


@pytest.fixture(scope="module")
def replicas(server, trio):
    """Two plain servers (shared with other tests) behind a router."""
    servers = [server, trio.agg]
    router = RouterProc("--workers", *(s.url for s in servers), "--model", MODEL)
    yield router, servers
    assert router.stop() == 0, router.output()


def test_every_dialect_is_relayed(replicas):
    router, _ = replicas
    oa = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3).usage
    assert oa.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].finish_reason
    # (ignore_eos / greedy: sampled at temperature 1, ~1% of these tiny-chat answers end on an EOS before 3 tokens)
    chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3
    assert oa.responses.create(model=MODEL, input="hi", max_output_tokens=3).status in ("completed", "incomplete")
    an = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0)
    assert an.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]).usage
    with an.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                            extra_body={"temperature": 0}) as s:
        assert s.get_final_message().stop_reason == "max_tokens"
    assert [m.id for m in oa.models.list()] == [MODEL]
    bad = _chat(router.url, "hi", temperature=9)  # the worker's own 400, in the dialect's shape, as it is
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    bad = httpx.post(router.url + "/v1/messages", json={"model": MODEL, "messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_a_msgpack_body_reaches_a_worker_and_its_answer_comes_back(replicas):
    router, _ = replicas
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    url = router.url + "/v1/chat/completions"
    want = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    packed = msgspec.msgpack.encode(body)
    r = httpx.post(url, content=packed, headers={"content-type": "application/msgpack"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == want, r.text
    r = httpx.post(url, content=packed, timeout=60,  # (trtllm-serve's orchestrator's way of saying it)
                   headers={"content-type": "application/json", "x-trtllm-msgpack": "1"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == want, r.text
    r = httpx.post(url, content=packed, headers={"content-type": "application/x-msgpack",
                                                 "accept": "application/msgpack"}, timeout=60)
    assert r.headers["content-type"].startswith("application/msgpack")
    assert msgspec.msgpack.decode(r.content)["choices"][0]["message"] == want
    r = httpx.post(url, content=b"\xc1", headers={"content-type": "application/msgpack"}, timeout=60)
    assert r.status_code == 400 and "msgpack" in r.json()["error"]["message"]


def test_repeated_prefixes_go_where_they_are_cached(replicas):
    router, servers = replicas
    before = router.metrics()
    cached = 0
    for i in range(8):
        r = _chat(router.url, PREFIX + f" Question {i}?")
        cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = router.metrics()
    hits, prompt = (_counter(after, f"sluice_router:{name}_total") - _counter(before, f"sluice_router:{name}_total")
                    for name in ("cache_hit_tokens", "prompt_tokens"))
    assert cached > 0.7 * prompt * 7 / 8  # every request after the first found the prefix where it went
    assert hits >= 0.9 * cached  # and the router knew it would, from the engines' block events


def test_a_worker_that_dies_is_taken_out_and_put_back(trio, monkeypatch):
    a, b = trio.agg, Server()
    router = RouterProc("--workers", a.url, b.url, "--model", MODEL)
    try:
        port = b.port
        b.stop(signal.SIGKILL)
        for i in range(6):  # none fails: a refused connection is retried on the other worker
            assert _chat(router.url, f"hello {i}").status_code == 200
        assert _counter(router.metrics(), "sluice_router:worker_up", kind="replica", worker=b.url) == 0
        b = Server(port=port)  # back at the address the router knows
        deadline = time.monotonic() + 10
        while not _counter(router.metrics(), "sluice_router:worker_up", kind="replica", worker=b.url):
            assert time.monotonic() < deadline, router.output()
            time.sleep(0.2)
        before = a.metrics().get("sluice:prompt_tokens_total", 0)
        for i in range(8):
            _chat(router.url, PREFIX[: 40 + 37 * i])
        assert a.metrics()["sluice:prompt_tokens_total"] > before and b.metrics().get("sluice:prompt_tokens_total")
    finally:
        router.stop()
        b.stop()


@pytest.fixture(scope="module")
def slow():
    """One replay server that steps every 50 ms, shared by the tests below in their order: the last one kills it."""
    server = Server("--runner", "replay", "--replay-step-ms", "50")
    yield server
    server.stop()


def test_a_client_that_leaves_mid_stream_frees_the_workers_request(slow):
    """The router closes its connection to the worker when its client goes: the worker aborts the request and
    frees its blocks, and the router serves the next request on a fresh connection."""
    router = RouterProc("--workers", slow.url, "--model", MODEL)
    try:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hi " * 100, "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            deadline = time.monotonic() + 15
            while not slow.metrics()["sluice:kv_cache_used_blocks"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        deadline = time.monotonic() + 10  # (the stream closed: the client left)
        while slow.metrics()["sluice:kv_cache_used_blocks"]:
            assert time.monotonic() < deadline, "the worker still holds the request's blocks"
            time.sleep(0.1)
        assert not slow.metrics().get("sluice:prompt_tokens_total")  # aborted: no request finished
        assert _chat(router.url, "again").status_code == 200
    finally:
        router.stop()


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie that its adopter has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_router_frees_its_requests_and_its_workers(slow):
    router = RouterProc("--workers", slow.url, "--model", MODEL)
    try:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hi " * 100, "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # (held: an iterator dropped closes the stream, and the router aborts)
            next(lines)
            deadline = time.monotonic() + 15
            while not slow.metrics()["sluice:kv_cache_used_blocks"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and ppid(int(p)) == router.proc.pid]
            assert workers
            router.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while slow.metrics()["sluice:kv_cache_used_blocks"] or any(map(_running, workers)):
            assert time.monotonic() < deadline, "blocks held, or a router worker outlived its parent"
            time.sleep(0.1)
    finally:
        router.stop()


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error(slow):
    router = RouterProc("--workers", slow.url, "--model", MODEL)
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            slow.stop(signal.SIGKILL)
            rest = list(lines)
        rest = [line for line in rest if line]
        assert any('"worker_failed"' in line for line in rest) and rest[-1] == "data: [DONE]"
    finally:
        router.stop()


# ---- disaggregated serving through the router ------------------------------------------------------------------

@pytest.fixture(scope="module")
def split(trio):
    router = RouterProc("--context", trio.ctx.url, "--generation", trio.gen.url, "--disagg-secret", SECRET,
                        "--model", MODEL, "--max-local-prefill", "0")
    yield router, trio.ctx, trio.gen, trio.agg
    router.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me of the sea. " * 12}]}),
    ("/v1/completions", {"prompt": "Once upon a time, far away, " * 8}),
], ids=["chat", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 9, "n": 2},
                                      {"temperature": 0.7, "seed": 4, "stream": True}],
                         ids=["greedy", "seeded-n2", "seeded-stream"])
def test_router_disaggregation_gives_the_aggregated_tokens(split, path, body, sampling):
    router, ctx, gen, agg = split
    req = {"model": MODEL, "max_tokens": 16, "return_token_ids": True, **body, **sampling}
    unique = f" ({json.dumps(sampling)})"  # a prompt the generation worker has not cached: it is split
    if "prompt" in req:
        req["prompt"] += unique
    else:
        req["messages"] = [{"role": "user", "content": req["messages"][0]["content"] + unique}]
    stream = bool(sampling.get("stream"))
    want = comparable(httpx.post(agg.url + path, json=req, timeout=60), stream)
    before = _counter(router.metrics(), "sluice_router:decisions_total", kind="disaggregated")
    assert comparable(httpx.post(router.url + path, json=req, timeout=60), stream) == want
    assert _counter(router.metrics(), "sluice_router:decisions_total", kind="disaggregated") == before + 1


def test_a_msgpack_body_is_split_too(split):
    router, ctx, gen, agg = split
    req = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
           "messages": [{"role": "user", "content": "A msgpack question about rivers. " * 12}]}
    want = comparable(httpx.post(agg.url + "/v1/chat/completions", json=req, timeout=60), False)
    before = _counter(router.metrics(), "sluice_router:decisions_total", kind="disaggregated")
    r = httpx.post(router.url + "/v1/chat/completions", content=msgspec.msgpack.encode(req), timeout=60,
                   headers={"content-type": "application/msgpack"})
    assert comparable(r, False) == want
    assert _counter(router.metrics(), "sluice_router:decisions_total", kind="disaggregated") == before + 1


def test_messages_are_split_too_and_a_client_cannot_forge_the_hand_off(split):
    router, ctx, gen, agg = split
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "A long question. " * 20}]}
    want = httpx.post(agg.url + "/v1/messages", json=body, timeout=60).json()["content"]
    got = httpx.post(router.url + "/v1/messages", json=body, timeout=60, headers={
        "x-sluice-disagg-secret": "guess", "x-sluice-disaggregated-params": '{"request_type": "generation_only"}'})
    assert got.status_code == 200 and got.json()["content"] == want  # the router drops a client's own headers
    forged = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 2,
        "disaggregated_params": {"request_type": "generation_only", "encoded_opaque_state": "eA=="}})
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "forbidden"
    hints = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 2,
        "kv_hints": {"protocol_version": "0.1", "message_id": "m", "actions": [{"action_type": "kv.retain"}]}})
    assert hints.status_code == 403 and "kv_hints" in hints.json()["error"]["message"]  # (the router holds the secret)


def test_a_context_worker_down_leaves_the_generation_worker_to_do_it_all(split):
    _, _, gen, _ = split
    down = f"http://127.0.0.1:{free_port()}"  # a context worker that is not there (killed, or never up)
    router = RouterProc("--context", down, "--generation", gen.url, "--disagg-secret", SECRET, "--model", MODEL,
                        "--max-local-prefill", "0")
    try:
        for i in range(3):
            assert _chat(router.url, f"{i} down " + PREFIX).status_code == 200
        text = router.metrics()
        assert _counter(text, "sluice_router:decisions_total", kind="disaggregated") == 0
        assert _counter(text, "sluice_router:worker_up", kind="context", worker=down) == 0
        assert gen.metrics()["sluice:kv_cache_used_blocks"] == 0
    finally:
        router.stop()


def test_a_context_worker_killed_mid_transfer(trio):
    """kill -9 of the context worker while requests are at every stage of the hand-off: at the context worker,
    between it and the generation worker, in the KV read, decoding, and not yet sent. Every request ends with
    the aggregated server's tokens (the router falls back to the generation worker alone; a read of the dead
    worker's cache finds it whole), no block stays held, and the next server to start removes what the killed
    one left in shared memory."""
    ctx = Server("--role", "context", "--disagg-secret", SECRET)
    router = RouterProc("--context", ctx.url, "--generation", trio.gen.url, "--disagg-secret", SECRET,
                        "--model", MODEL, "--max-local-prefill", "0")
    try:
        reqs = [{"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True, "stream": i % 2 == 1,
                 "messages": [{"role": "user", "content": f"Storm {i}. " + PREFIX}]} for i in range(24)]
        wants = [comparable(httpx.post(trio.agg.url + "/v1/chat/completions", json=r, timeout=60), r["stream"])
                 for r in reqs]
        with ThreadPoolExecutor(4) as pool:
            sent = [pool.submit(httpx.post, router.url + "/v1/chat/completions", json=r, timeout=60) for r in reqs]
            sent[0].result()  # one through: three are somewhere in the hand-off, twenty to come
            ctx.stop(signal.SIGKILL)
            got = [f.result() for f in sent]
        assert [comparable(g, r["stream"]) for g, r in zip(got, reqs)] == wants
        text = router.metrics()
        kinds = {k: _counter(text, "sluice_router:decisions_total", kind=k)
                 for k in ("disaggregated", "context_failed", "local_prefill")}
        assert sum(kinds.values()) == len(reqs) and kinds["disaggregated"] >= 1, kinds
        assert kinds["context_failed"] + kinds["local_prefill"] >= 1, kinds
        deadline = time.monotonic() + 10
        while kv_used(trio.gen):
            assert time.monotonic() < deadline, "the generation worker holds blocks"
            time.sleep(0.1)
        left = [os.path.dirname(p) for p in glob.glob(os.path.join(shm_base(), "sluice-*", "owner"))
                if open(p).read() == str(ctx.proc.pid)]
        assert len(left) == 1 and os.path.exists(os.path.join(left[0], "kv-0"))  # its KV cache, in RAM
        live = {os.path.dirname(p) for p in glob.glob(os.path.join(shm_base(), "sluice-*", "owner"))} - set(left)
        assert left[0] in sweep_orphans() and not os.path.exists(left[0])
        assert all(os.path.isdir(d) for d in live)  # a live server's directory stays
    finally:
        router.stop()
        ctx.stop()


def test_the_router_counts_transfers(split):
    router, *_ = split
    _chat(router.url, "Count me. " * 30)
    text = router.metrics()
    assert _counter(text, "sluice_router:kv_transfer_seconds_count") >= 1
    assert _counter(text, "sluice_router:context_seconds_count") >= 1
    assert json.loads(httpx.get(router.url + "/health").text) == {}


def test_workers_that_refuse_the_hand_off_still_serve(split):
    """Workers without disaggregation (another version, another role; here the plain server): as the context
    worker it answers 400 naming disaggregated_params, as the generation worker too; the router serves the
    request whole instead."""
    _, ctx, gen, plain = split
    routers = [RouterProc("--context", plain.url, "--generation", gen.url, "--disagg-secret", SECRET,
                          "--model", MODEL, "--max-local-prefill", "0"),
               RouterProc("--context", ctx.url, "--generation", plain.url, "--disagg-secret", SECRET,
                          "--model", MODEL, "--max-local-prefill", "0")]
    try:
        req = {"temperature": 0, "return_token_ids": True, "max_tokens": 8}
        want = comparable(_chat(plain.url, "Hello there. " * 20, **req), False)
        for router, kind in zip(routers, ("context_failed", "handoff_refused")):
            assert comparable(_chat(router.url, "Hello there. " * 20, **req), False) == want
            assert _counter(router.metrics(), "sluice_router:decisions_total", kind=kind) == 1
    finally:
        for r in routers:
            r.stop()


def test_a_router_with_keys_serves_key_protected_workers_and_guards_its_own_routes():
    """Workers that want a key on every route (--api-key --protect-metrics): the router sends its
    --worker-api-key on each call (health, what they serve, their block events' address, requests), asks its own
    clients for its own --api-key (its /metrics and health too with --protect-metrics), and routes by cache."""
    worker = Server("--api-key", "worker-key", "--protect-metrics", headers={"Authorization": "Bearer worker-key"})
    try:
        refused = subprocess.run([sys.executable, "-m", "sluice", "router", "--port", "0", "--workers", worker.url,
                                  "--model", MODEL], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "--worker-api-key" in refused.stderr, refused.stderr
        router = RouterProc("--workers", worker.url, "--model", MODEL, "--worker-api-key", "worker-key",
                            "--api-key", "router-key", "--protect-metrics",
                            headers={"Authorization": "Bearer router-key"})
        try:
            for path in ("/health", "/metrics", "/v1/models"):
                assert httpx.get(router.url + path, timeout=10).status_code == 401
            bad = httpx.post(router.url + "/v1/messages", json={"model": MODEL}, timeout=10,
                             headers={"x-api-key": "worker-key"})  # (the workers' key is not the router's)
            assert bad.status_code == 401 and bad.json()["type"] == "error", bad.text
            key = {"Authorization": "Bearer router-key"}
            assert httpx.get(router.url + "/v1/models", headers=key, timeout=10).json()["data"][0]["id"] == MODEL
            for i in range(4):
                r = httpx.post(router.url + "/v1/chat/completions", headers=key, timeout=60, json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": PREFIX + str(i)}]})
                assert r.status_code == 200, r.text
            metrics = httpx.get(router.url + "/metrics", headers=key, timeout=10).text
            hits = _counter(metrics, "sluice_router:cache_hit_tokens_total")
            assert hits > 0, router.output()  # it knew what the worker held: its block events reached it
            an = anthropic.Anthropic(base_url=router.url, api_key="router-key", max_retries=0)
            assert an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).usage
        finally:
            assert router.stop() == 0, router.output()
    finally:
        worker.stop()
