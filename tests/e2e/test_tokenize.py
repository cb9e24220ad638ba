"""vLLM's /tokenize and /detokenize, and GET /v1/models/{model}, against a real server."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "builtin:tiny-chat"
HI = [{"role": "user", "content": "Hello there"}]


def _post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_a_prompts_ids_are_what_generation_counts_and_decode_back(server):
    r = _post(server, "/tokenize", model=MODEL, prompt="Once upon a time")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] > 0 and got.get("token_strs") is None
    done = _post(server, "/v1/completions", model=MODEL, prompt="Once upon a time", max_tokens=1).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    assert _post(server, "/detokenize", model=MODEL, tokens=got["tokens"]).json() == {"prompt": "Once upon a time"}


def test_chat_messages_are_rendered_as_a_chat_request_renders_them(server):
    got = _post(server, "/tokenize", messages=HI, return_token_strs=True).json()  # (model left out: the served one)
    done = _post(server, "/v1/chat/completions", model=MODEL, messages=HI, max_tokens=1).json()
    assert done["usage"]["prompt_tokens"] == got["count"] == len(got["token_strs"])
    assert "<|im_start|>" in got["token_strs"]  # the template's special tokens, as the model sees them
    text = _post(server, "/detokenize", tokens=got["tokens"]).json()["prompt"]
    assert text.startswith("<|im_start|>user\nHello there") and text.endswith("<|im_start|>assistant\n")
    bare = _post(server, "/tokenize", messages=HI, add_generation_prompt=False).json()
    assert bare["count"] < got["count"] and got["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": MODEL}, None),  # neither a prompt nor messages
    ("/tokenize", {"prompt": "x", "messages": HI}, None),  # both
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),  # not taken: said so
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),  # past the vocabulary
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_what_cannot_be_answered_is_a_400_that_says_why(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_is_a_404(server):
    r = _post(server, "/tokenize", model="nope", prompt="x")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_one_models_card_is_retrieved_as_the_sdk_asks(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["sampling_defaults"] == {}  # (tiny-chat's set none)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/not-served")
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert httpx.get(server.url + "/v1/models/" + MODEL, timeout=10).json() == listed
