"""The OpenAI SDK and raw HTTP against the real server processes."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import openai
import pytest

from tests.e2e.conftest import MODEL

HI = [{"role": "user", "content": "Hello there, how are you?"}]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole.choices[0].text


def test_prompt_token_ids_and_exact_usage(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 3, 7)


def test_stream_null_is_not_streaming(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                                               "stream": None, "user": "u1"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["object"] == "chat.completion"


def test_seed_reproducible_alone_and_batched(client, aclient):
    kw = dict(model=MODEL, messages=HI, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert client.chat.completions.create(seed=1234, **kw).choices[0].message.content == alone

    async def batched():
        async with aclient() as ac:
            tasks = [ac.chat.completions.create(seed=s, **kw) for s in (1, 2, 1234, 3, 4, 5)]
            return [r.choices[0].message.content for r in await asyncio.gather(*tasks)]

    texts = asyncio.run(batched())
    assert texts[2] == alone
    assert len(set(texts)) > 1  # different seeds, different samples


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="hello there", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]


def test_stop_token_ids_min_tokens_and_logit_bias(client):
    every_id = list(range(700))
    r = client.completions.create(model=MODEL, prompt="hello there", max_tokens=10,
                                  extra_body={"stop_token_ids": every_id})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    # Token 5 is forced by the bias, so it is the first token unless min_tokens masks it.
    kw = dict(model=MODEL, prompt="hello there", max_tokens=10, temperature=0, logit_bias={"5": 100})
    r = client.completions.create(extra_body={"stop_token_ids": [5]}, **kw)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    r = client.completions.create(extra_body={"stop_token_ids": [5], "min_tokens": 4}, **kw)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 5)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("body, status, param, code", [
    (b'{"model": "builtin:tiny-chat", "messages": [', 400, None, None),
    (b'[1, 2]', 400, None, None),
    (json.dumps({"model": MODEL, "messages": HI, "max_tokens": "ten"}).encode(), 400, "max_tokens", None),
    (json.dumps({"model": MODEL, "messages": HI, "temperature": 9}).encode(), 400, "temperature", None),
    (json.dumps({"model": MODEL, "messages": HI, "frobnicate": True}).encode(), 400, "frobnicate", None),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400,
     "messages[0].role", None),
    (json.dumps({"model": MODEL, "messages": HI, "n": 500}).encode(), 400, "n", None),
    (json.dumps({"messages": HI}).encode(), 400, "model", None),
    (json.dumps({"model": "gpt-nope", "messages": HI}).encode(), 404, "model", "model_not_found"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400,
     "messages", "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = _error(r)
    assert err["param"] == param and err["code"] == code
    if param == "frobnicate":
        assert "frobnicate" in err["message"]


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi " * 5000, stream=True)
    assert e.value.code == "context_length_exceeded"


def test_bad_requests_do_not_disturb_a_stream_in_flight(server, client):
    kw = dict(model=MODEL, messages=HI, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kw)
    parts = [next(stream).choices[0].delta.content]
    for body in (b"{", b'{"model": 1}', json.dumps({"model": MODEL, "messages": HI, "top_p": 0}).encode()):
        assert httpx.post(server.url + "/v1/chat/completions", content=body).status_code == 400
    parts += [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == reference


def test_many_concurrent_requests_all_complete(aclient):
    async def run():
        kw = dict(model=MODEL, max_tokens=8, extra_body={"ignore_eos": True})
        async with aclient() as ac:
            chats = [ac.chat.completions.create(messages=[{"role": "user", "content": f"q{i}"}], **kw)
                     for i in range(24)]
            streams = [consume(await ac.completions.create(prompt=f"p{i}", stream=True, **kw)) for i in range(8)]
            return await asyncio.gather(*chats), await asyncio.gather(*streams)

    async def consume(stream):
        return [c async for c in stream]

    chats, streams = asyncio.run(run())
    assert all(r.usage.completion_tokens == 8 for r in chats)
    assert all(s[-1].choices[0].finish_reason == "length" for s in streams)


def test_client_disconnect_aborts_and_frees_kv(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    before = server.metrics()["sluice:generation_tokens_total"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics()["sluice:kv_cache_used_blocks"] > 0
    deadline = time.monotonic() + 10
    while (m := server.metrics())["sluice:kv_cache_used_blocks"] > 0 or m["sluice:num_requests_running"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    generated = m["sluice:generation_tokens_total"]
    assert generated - before < 1000  # stopped long before its 4000 tokens
    time.sleep(0.5)
    assert server.metrics()["sluice:generation_tokens_total"] == generated  # nothing more generated for it


def test_health_version_and_unknown_route(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"


# ---- msgpack bodies (issue 34) -------------------------------------------------------------------------------

def _same_fields(path: str, answer: dict) -> object:
    """What two answers to the same request share (ids, times and the prefix cache's hits differ)."""
    usage = {k: v for k, v in (answer.get("usage") or {}).items() if "cache" not in k and "details" not in k}
    if path == "/v1/responses":
        return answer["status"], usage, [c.get("text") for item in answer["output"] for c in item.get("content") or []]
    if path == "/v1/messages":
        return answer["content"], usage, answer["stop_reason"]
    if path in ("/v1/chat/completions", "/v1/completions"):
        return answer["choices"], usage
    return answer


MSGPACK_CASES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "The quick brown", "max_tokens": 5, "temperature": 0}),
    ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0}),
    ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 5, "temperature": 0, "store": False}),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": HI}),
    ("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": {"model": MODEL, "max_tokens": 1,
                                                                         "messages": HI}}] * 2}),  # (a 400)
    ("/tokenize", {"model": MODEL, "prompt": "hello world"}),
    ("/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}),
    ("/v1/chat/completions/chatcmpl-none", {"metadata": {"k": "v"}}),  # (a 404)
]


@pytest.mark.parametrize("path, body", MSGPACK_CASES, ids=[p for p, _ in MSGPACK_CASES])
def test_a_msgpack_body_gets_the_answer_its_json_gets(server, path, body):
    url = server.url + path
    as_json = httpx.post(url, json=body, timeout=60)
    as_msgpack = httpx.post(url, content=msgspec.msgpack.encode(body), timeout=60,
                            headers={"content-type": "application/msgpack"})
    assert as_msgpack.status_code == as_json.status_code, as_msgpack.text
    assert as_json.headers["content-type"] == as_msgpack.headers["content-type"] == "application/json"
    assert _same_fields(path, as_msgpack.json()) == _same_fields(path, as_json.json())


def test_trtllm_orchestrators_msgpack_header_is_taken(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", content=msgspec.msgpack.encode(body), timeout=60,
                   headers={"content-type": "application/json", "x-trtllm-msgpack": "1"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize",
                                  "/v1/messages/count_tokens"])
def test_a_malformed_msgpack_body_is_a_400_in_the_routes_dialect(server, path):
    r = httpx.post(server.url + path, content=b"\x81\xa5model\xc1", timeout=60,
                   headers={"content-type": "application/x-msgpack"})
    assert r.status_code == 400
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert "invalid msgpack body" in r.json()["error"]["message"]
    else:
        assert "invalid msgpack body" in r.json()["error"]["message"]


def test_accept_msgpack_gets_a_msgpack_body_and_a_stream_stays_sse(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"accept": "application/msgpack"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                   headers={"accept": "application/msgpack"}, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream") and r.text.endswith("data: [DONE]\n\n")
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "nope"},
                   headers={"accept": "application/msgpack"}, timeout=60)
    assert r.status_code == 404 and msgspec.msgpack.decode(r.content)["error"]["param"] == "model"


def test_prometheus_metrics_is_metrics(server):
    r = httpx.get(server.url + "/prometheus/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "sluice:num_requests_running" in r.text


def test_a_1mb_field_name_does_not_come_back_whole(server):
    name = "f" * (1 << 20)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   content=b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "%s": 1}'
                   % (MODEL.encode(), name.encode()))
    error = r.json()["error"]
    assert r.status_code == 400 and len(error["message"]) <= 4096 and len(error["param"]) <= 4096
    assert len(r.content) < 10_000 and error["message"].startswith("unknown field 'fff")
