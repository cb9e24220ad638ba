"""`sluice serve model.gguf`: one GGUF file served end to end (its tokenizer, chat template and weights from the
file, its linears kept quantized)."""
from __future__ import annotations

import httpx
import pytest

from bench.server import Server
from sluice.app.builtin_models import write_llama_family
from sluice.app.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    checkpoint = write_llama_family(root / "checkpoint", architecture="Qwen3ForCausalLM", num_shards=1)
    file = write_gguf(checkpoint, root / "tiny.gguf", {"ffn_down": "Q4_0", "ffn_gate": "Q4_1"})
    s = Server(str(file), "--max-model-len", "1024", "--render-workers", "1", "--postproc-workers", "1",
               "--ingress-workers", "1")
    yield s, file
    assert s.stop() == 0, s.output()


def test_a_gguf_file_answers_a_chat_request_with_its_own_template_and_quantized_linears(gguf_server):
    server, file = gguf_server
    messages = [{"role": "user", "content": "Hello there"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": str(file), "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == str(file)
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] >= 1
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "return_token_strs": True},
                        timeout=30).json()
    assert body["usage"]["prompt_tokens"] == tokens["count"]
    assert "<|im_start|>" in tokens["token_strs"]  # the file's chat template, its special tokens whole
    log = server.output()
    assert "GGUF tiny.gguf: " in log and "Q4_0 x2" in log and "Q4_1 x2" in log and "Q8_0 x" in log
    assert "linears on QuantMatmul" in log
    assert " KV blocks of 16 tokens in float16 " in log  # (--kv-cache-dtype auto under quantized linears)
