"""The render side of issue 15: integers at the edges of their widths, prompts too long to tokenize, chat
templates that run away, deep nesting, and completions' base64 prompt."""
from __future__ import annotations

import base64
import dataclasses
import json
import signal
import time
from contextlib import contextmanager

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.base.config import ServerConfig
from sluice.ingress.http import validation_error
from sluice.ipc.messages import EngineInput, PostprocSpec, RenderJob, bytes_to_ids
from sluice.render import chat_template
from sluice.render.core import MAX_JSON_DEPTH
from sluice.render.errors import RequestError
from sluice.render.tokenizer import PromptBudget
from sluice.render.worker import build_core
from sluice.schemas.openai import INT32_MAX, INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest
from tests.render.edge_bodies import EDGES, FIELDS, body, names, request_integer_types

REQUESTS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
HI = [{"role": "user", "content": "hi"}]
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def core(tiny_chat_dir):
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=64, postproc_workers=2, trust_request_chat_template=True)
    return build_core(cfg)


def job(endpoint: str, **fields) -> RenderJob:
    return raw_job(endpoint, json.dumps({"model": "m", **fields}).encode())


def raw_job(endpoint: str, raw: bytes) -> RenderJob:
    return RenderJob("req-1", endpoint, raw, "ipc://reply", 1000.0)


@contextmanager
def roomy(core, max_model_len: int = 40_000):
    """A longer context than the fixture's 64 tokens, for the duration."""
    core.max_model_len = max_model_len
    try:
        yield core
    finally:
        core.max_model_len = 64


def refusal(core, endpoint: str, **fields) -> RequestError:
    with pytest.raises(RequestError) as e:
        core.render(job(endpoint, **fields))
    assert e.value.status == 400
    return e.value


# ---- integers ----------------------------------------------------------------

@pytest.mark.parametrize("request_type", [ChatCompletionRequest, CompletionRequest])
def test_every_request_integer_is_bounded_where_declared(request_type):
    found = request_integer_types(request_type)
    assert {"top_k", "seed", "priority", "stop_token_ids[]"} <= {path for path, _ in found}
    for path, t in found:
        low = t.ge if t.ge is not None else t.gt
        high = t.le if t.le is not None else t.lt
        assert low is not None and high is not None, f"{path} is unbounded"
        assert INT64_MIN <= low and high <= INT64_MAX, path
        if "token_ids" in path:
            assert high <= INT32_MAX, f"{path}: token ids travel as int32"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_edge_tests_set_every_integer_field(endpoint):
    fields = {path.split(".")[0].split("[")[0] for path, _ in request_integer_types(REQUESTS[endpoint])}
    # (disaggregated_params come from the trusted orchestrator only: any client gets 403, tests/disagg)
    assert fields - {"disaggregated_params"} <= set(FIELDS[endpoint])


@given(endpoint=st.sampled_from(["chat", "completions"]), data=st.data(),
       value=st.one_of(st.integers(), st.sampled_from(EDGES)))
@settings(FUZZ, max_examples=600)
def test_any_integer_in_any_field_renders_or_is_a_400_naming_it(core, endpoint, data, value):
    field = data.draw(st.sampled_from(FIELDS[endpoint]))
    raw = json.dumps(body(endpoint, field, value)).encode()
    try:
        msgspec.json.decode(raw, type=REQUESTS[endpoint])  # as the ingress does
    except msgspec.ValidationError as e:
        param = validation_error(e)[1]
        assert names(param, field), (field, value, str(e))
        return
    try:
        request = core.render(raw_job(endpoint, raw))
    except RequestError as e:
        assert e.status == 400 and names(e.param, field), (field, value, e.message, e.param)
        return
    # as the engine gets it: through msgpack, into int64 arrays
    request = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineInput)
    sp = request.sampling
    np.array([sp.top_k, sp.seed or 0, request.priority, sp.max_tokens, sp.min_tokens], dtype=np.int64)
    assert 0 <= sp.top_k < core.model_vocab_size
    assert all(0 <= t < core.model_vocab_size for t in sp.stop_token_ids)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", ["1e308", "-1e308", "1e400", "-1e400"])
def test_floats_out_of_range_are_a_400_naming_the_field(field, value):
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(f'{{"model": "m", "prompt": "hi", "{field}": {value}}}'.encode(), type=CompletionRequest)
    assert validation_error(e.value)[1] == field


def test_top_k_past_the_vocabulary_means_every_token(core):
    for top_k in (core.model_vocab_size, INT32_MAX):
        assert core.render(job("completions", prompt="hi", top_k=top_k)).sampling.top_k == 0
    assert core.render(job("completions", prompt="hi", top_k=5)).sampling.top_k == 5


def test_stop_token_ids_past_the_vocabulary_are_refused(core):
    assert refusal(core, "completions", prompt="hi", stop_token_ids=[core.model_vocab_size]).param == "stop_token_ids"


def test_logit_bias_keys_past_the_vocabulary_or_not_numbers_are_refused(core):
    for key in (str(2**64), "-1", "9" * 5000, "x"):
        assert refusal(core, "completions", prompt="hi", logit_bias={key: 1}).param == "logit_bias"


def test_unsupported_features_name_their_field(core):
    assert refusal(core, "chat", messages=HI, thinking_token_budget=10).param == "thinking_token_budget"


# ---- prompts too long to tokenize ---------------------------------------------

class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text: str, add_special_tokens: bool):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_max_token_chars_is_the_longest_token(core):
    tok = core.bundle.tokenizer
    longest = max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.get_vocab_size()))
    assert core.bundle.max_token_chars >= longest and core.bundle.max_token_chars == 13


def test_a_text_longer_than_the_budget_is_refused_without_tokenizing(core):
    budget, spy = PromptBudget(64, core.bundle.max_token_chars), CountingTokenizer(core.bundle.tokenizer)
    with pytest.raises(RequestError) as e:
        budget.encode(spy, "x" * (budget.max_chars + 1), add_special_tokens=False)
    assert e.value.code == "context_length_exceeded" and spy.lengths == []


def test_a_long_text_whose_start_is_over_the_budget_is_refused_on_its_start(core):
    budget, spy = PromptBudget(100, 128), CountingTokenizer(core.bundle.tokenizer)
    with pytest.raises(RequestError) as e:
        budget.encode(spy, "word " * 2000, add_special_tokens=False)
    assert e.value.code == "context_length_exceeded" and spy.lengths and max(spy.lengths) <= 800


# (no lone surrogates: JSON bodies cannot carry them)
@given(text=st.text(st.sampled_from(list("ab c  \n\t!1é日🙂")) | st.characters(exclude_categories=["Cs"]),
                    max_size=3000),
       max_tokens=st.integers(1, 400), token_chars=st.integers(13, 1000))
@settings(FUZZ, max_examples=300)
def test_the_budget_refuses_only_prompts_that_do_not_fit(core, text, max_tokens, token_chars):
    """Sound for any bound at least the longest token (13 characters here): a larger one leaves more to the
    first-part check."""
    tokenizer = core.bundle.tokenizer
    n = len(tokenizer.encode(text, add_special_tokens=False).ids)
    budget = PromptBudget(max_tokens, token_chars)
    try:
        ids = budget.encode(tokenizer, text, add_special_tokens=False)
    except RequestError:
        assert n > max_tokens
    else:
        assert len(ids) == n


@pytest.mark.parametrize("endpoint, fields", [
    ("chat", dict(messages=[{"role": "user", "content": "word " * 4_000_000}])),
    ("chat", dict(messages=[{"role": "system", "content": [{"type": "text", "text": "w " * 10_000_000}]},
                            {"role": "user", "content": "hi"}])),
    ("completions", dict(prompt="word " * 4_000_000)),
    ("completions", dict(prompt=["word " * 4_000_000])),
])
def test_a_20_mb_prompt_is_refused_at_once(core, endpoint, fields, monkeypatch):
    """Without tokenizing it (seconds and gigabytes at 20 MB): the tokenizer is handed no more characters than
    the context could hold (a count, where a time bound would flake on loaded cores)."""
    counting = _CountingTokenizer(core.bundle.tokenizer)
    monkeypatch.setattr(core, "bundle", dataclasses.replace(core.bundle, tokenizer=counting))
    e = refusal(core, endpoint, **fields)
    assert e.code == "context_length_exceeded" and counting.chars <= core.budget.max_chars < 100_000


class _CountingTokenizer:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text: str, *args, **kwargs):
        self.chars += len(text)
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_batch(self, texts: list[str], *args, **kwargs):
        self.chars += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_a_long_assistant_message_is_caught_on_the_rendered_text(core):
    msgs = [{"role": "assistant", "content": "word " * 1_000_000}, *HI]
    assert refusal(core, "chat", messages=msgs).code == "context_length_exceeded"


def test_bad_words_longer_than_any_output_are_refused(core):
    assert refusal(core, "completions", prompt="hi", bad_words=["w" * 100_000]).param == "bad_words"


# ---- chat templates -----------------------------------------------------------

@pytest.fixture
def quick_timeout(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% if j is divisibleby 7 %}{% endif %}"
    "{% endfor %}{% endfor %}",
])
def test_a_template_that_runs_too_long_is_the_clients_400(core, quick_timeout, template):
    handler, (timer, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    start = time.process_time()
    e = refusal(core, "chat", messages=HI, chat_template=template)
    assert e.param == "chat_template" and "longer than 0.5 s" in e.message
    assert time.process_time() - start < 2.0  # (this process's CPU, 4x the limit: the loop alone runs for hours)
    # the alarm is put back as it was (pytest-timeout's, if it runs one)
    assert signal.getsignal(signal.SIGALRM) == handler
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer > 0)


@pytest.mark.parametrize("template", [
    "{{ 10 ** 100000000 }}",
    "{% set n = 10 ** 1000 %}{{ n * n * n * n * n }}",
    "{{ 'x' * 10 ** 9 }}",
    "{{ [0] * 10 ** 9 }}",
    "{{ 1 / 0 }}",
    "{{ messages[0].content.nope() }}",
    "{% for %}",
    "{{ raise_exception('no') }}",
])
def test_a_template_that_fails_is_the_clients_400(core, template):
    start = time.process_time()
    assert refusal(core, "chat", messages=HI, chat_template=template).param == "chat_template"
    # refused at once, not at the template's time limit (also a 400): this process's CPU, so a load elsewhere
    # does not count; 1 s against the limit's 5
    assert time.process_time() - start < 1.0


def test_a_template_whose_output_cannot_fit_stops_early(core):
    template = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    # (stopped at the characters the context holds: its time limit would have named chat_template instead)
    assert refusal(core, "chat", messages=HI, chat_template=template).code == "context_length_exceeded"


def test_chat_template_kwargs_may_name_what_the_server_passes(core):
    template = "{{ add_generation_prompt }}|{{ messages | length }}|{{ eos_token }}"
    req = core.render(job("chat", messages=HI, chat_template=template,
                          chat_template_kwargs={"add_generation_prompt": "yes", "messages": [], "eos_token": "E"}))
    assert core.bundle.tokenizer.decode(bytes_to_ids(req.prompt_token_ids).tolist()) == "yes|1|E"


def test_a_template_runs_unchanged_within_the_limits(core):
    template = "{% for m in messages %}{{ m.content * 2 }}{% endfor %}{{ 2 ** 10 }}"
    req = core.render(job("chat", messages=HI, chat_template=template))
    assert core.bundle.tokenizer.decode(bytes_to_ids(req.prompt_token_ids).tolist()) == "hihi1024"


# ---- nesting --------------------------------------------------------------------

def nested(levels: int) -> dict:
    """A JSON schema whose dicts nest `levels` deep."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 900])
@pytest.mark.parametrize("fields, param", [
    (lambda schema: dict(tools=[tool({}), tool(schema)]), "tools[1].function.parameters"),
    (lambda schema: dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}),
     "response_format.json_schema.schema"),
    (lambda schema: dict(chat_template_kwargs={"x": schema}), "chat_template_kwargs"),
])
def test_deep_nesting_is_a_400_naming_the_field(core, levels, fields, param):
    assert refusal(core, "chat", messages=HI, **fields(nested(levels))).param == param


def test_nesting_too_deep_to_decode_is_a_400(core):
    raw = json.dumps({"model": "m", "messages": HI, "tools": [tool({})]}).encode()
    raw = raw.replace(b'"parameters": {}', b'"parameters": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000)
    with pytest.raises(RequestError) as e:
        core.render(raw_job("chat", raw))
    assert e.value.status == 400


def test_nesting_within_the_limit_renders(core):
    with roomy(core):
        core.render(job("chat", messages=HI, tools=[tool(nested(MAX_JSON_DEPTH))]))


def test_deeply_nested_tool_call_arguments_render(core):
    arguments = '{"a": ' * 5000 + "1" + "}" * 5000
    msgs = [*HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    with roomy(core):
        core.render(job("chat", messages=msgs))


# ---- completions' prompt_token_ids_b64 -------------------------------------------

def b64(ids: list[int]) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def test_echo_repeats_a_base64_prompt(core):
    ids = core.bundle.tokenizer.encode("hello there", add_special_tokens=False).ids
    req = core.render(job("completions", prompt="", prompt_token_ids_b64=b64(ids), echo=True))
    assert msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec).echo == "hello there"
    assert bytes_to_ids(req.prompt_token_ids).tolist() == ids
    plain = core.render(job("completions", prompt_token_ids_b64=b64(ids)))
    assert msgspec.msgpack.decode(plain.postproc_spec, type=PostprocSpec).echo == ""


@pytest.mark.parametrize("prompt", ["hello", [5, 6], ["hello"]])
def test_a_prompt_and_a_base64_prompt_together_are_refused(core, prompt):
    assert refusal(core, "completions", prompt=prompt, prompt_token_ids_b64=b64([5])).param == "prompt_token_ids_b64"

