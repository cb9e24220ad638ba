"""`--kv-cache-dtype int8` served end to end: the engine keeps the 8-bit cache, and the official SDK's streamed
greedy answer is its non-streamed one (tests/engine/test_f32_kernels.py holds the kernels' bytes and tokens to
torch's path)."""
from __future__ import annotations

import pytest
from openai import OpenAI

from bench.server import Server
from sluice.app.builtin_models import write_llama_family
from sluice.engine.cpu.build import cpu_flags


@pytest.fixture(scope="module")
def int8_cache_server(tmp_path_factory):
    path = write_llama_family(tmp_path_factory.mktemp("kv") / "m", architecture="Qwen3ForCausalLM", num_shards=1)
    s = Server(str(path), "--kv-cache-dtype", "int8", "--max-model-len", "1024", "--render-workers", "1",
               "--postproc-workers", "1", "--ingress-workers", "1")
    yield s, str(path)
    assert s.stop() == 0, s.output()


def test_an_int8_cache_serves_the_same_greedy_answer_streamed_and_whole(int8_cache_server):
    server, model = int8_cache_server
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name three rivers and say where each one runs."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert whole.usage.completion_tokens == 24 or whole.choices[0].finish_reason == "stop"
    assert text == whole.choices[0].message.content
    log = server.output()
    assert " KV blocks of 16 tokens in int8 " in log
    if {"avx2", "fma"} <= cpu_flags():
        assert "one call" in log  # (the step in one call took the 8-bit cache)
