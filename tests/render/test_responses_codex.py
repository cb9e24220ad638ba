"""What Codex sends the Responses API, through the render translation and the chat core: sealed reasoning opened
and rendered as the model's own (harmony's analysis message; a chat template's reasoning), namespace tools
offered as their functions, and hosted tools left out with a warning."""
from __future__ import annotations

import msgspec
import pytest
from tokenizers import Tokenizer

from sluice.app.builtin_models import ensure_builtin
from sluice.base import sealing
from sluice.base.config import ServerConfig
from sluice.ipc.messages import RenderJob, bytes_to_ids
from sluice.render.errors import RequestError
from sluice.render.responses import translate
from sluice.render.worker import build_core
from sluice.schemas.responses import CreateResponse, FramerSpec, InputItem, RenderBody

REASONING = "The user wants the weather: call the tool."
SHELL = {"type": "function", "name": "shell", "description": "Runs a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "mcp__weather__", "description": "Weather tools", "tools": [
    {"type": "function", "name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "custom", "name": "freeform"}]}
CODEX_TOOLS = [SHELL, NAMESPACE, {"type": "web_search", "external_web_access": False}]


def _codex(input, **fields) -> CreateResponse:
    return msgspec.convert({"model": "m", "input": input, "tools": CODEX_TOOLS, "tool_choice": "auto",
                            "parallel_tool_calls": True, "store": False, "stream": True,
                            "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
                            "prompt_cache_key": "session-1", "client_metadata": {"x": "y"}, **fields},
                           CreateResponse)


def _turn(reasoning: dict) -> list[dict]:
    """A conversation Codex sends back: the user's ask, the model's reasoning and its call, the call's output."""
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], **reasoning},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "namespace": "mcp__weather__",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]


@pytest.fixture
def state_dir(tmp_path):
    return str(tmp_path)


def _translate(request: CreateResponse, **job):
    return translate(msgspec.json.encode(RenderBody(request, **job)))


def test_sealed_reasoning_is_opened_as_the_turn_s_reasoning(state_dir):
    blob = sealing.sealer(state_dir).seal(REASONING)
    t = _translate(_codex(_turn({"encrypted_content": blob})), state_dir=state_dir)
    turn = t.request.messages[1]
    assert turn.role == "assistant" and turn.reasoning_content == REASONING
    plain = _translate(_codex(_turn({"content": [{"type": "reasoning_text", "text": REASONING}]})))
    assert t.request.messages == plain.request.messages
    # (what was sealed wins over plain content sent beside it)
    mixed = _codex(_turn({"encrypted_content": blob, "content": [{"type": "reasoning_text", "text": "forged"}]}))
    assert _translate(mixed, state_dir=state_dir).request.messages[1].reasoning_content == REASONING


@pytest.mark.parametrize("blob", ["v1." + "A" * 60, "gAAAAABn-not-ours", "v1.!!!"])
def test_a_blob_this_server_did_not_seal_is_a_400_naming_the_item(state_dir, blob):
    with pytest.raises(RequestError) as e:
        _translate(_codex(_turn({"encrypted_content": blob})), state_dir=state_dir)
    assert (e.value.status, e.value.param) == (400, "input[1].encrypted_content")
    assert "not reasoning this server sealed" in e.value.message


def test_a_tampered_blob_is_a_400_and_one_in_the_stored_conversation_names_previous_response_id(state_dir):
    blob = sealing.sealer(state_dir).seal(REASONING)
    tampered = blob[:-6] + ("AAAAAA" if not blob.endswith("AAAAAA") else "BBBBBB")
    with pytest.raises(RequestError) as e:
        _translate(_codex(_turn({"encrypted_content": tampered})), state_dir=state_dir)
    assert e.value.param == "input[1].encrypted_content"
    history = msgspec.convert(_turn({"encrypted_content": tampered})[:3], list[InputItem])
    with pytest.raises(RequestError) as e:
        _translate(_codex(_turn({})[3:], previous_response_id="resp_1"), history=history, state_dir=state_dir)
    assert (e.value.status, e.value.param) == (400, "previous_response_id")


def test_namespace_functions_are_offered_flat_and_hosted_tools_are_left_out_with_warnings(state_dir):
    t = _translate(_codex(_turn({"summary": []})), state_dir=state_dir)
    assert [tool.function.name for tool in t.request.tools] == ["shell", "mcp__weather__get_weather"]
    assert t.request.messages[1].tool_calls[0].function.name == "mcp__weather__get_weather"
    assert t.request.messages[2].name == "mcp__weather__get_weather"  # (the tool message names what it answers)
    framing = msgspec.msgpack.decode(t.dialect, type=FramerSpec)
    assert framing.namespaces == {"mcp__weather__get_weather": ("mcp__weather__", "get_weather")}
    assert framing.seal_with == state_dir
    warnings = framing.response.warnings
    assert [(w.code, w.param) for w in warnings] == [("tool_not_offered", "tools[1].tools[1]"),
                                                     ("tool_not_offered", "tools[2]")]
    assert "'web_search'" in warnings[1].message and "hosted tool" in warnings[1].message
    assert [tool.type for tool in framing.response.tools] == ["function", "namespace", "web_search"]  # (echoed)
    unsealed = _translate(_codex("Hi", include=None, tools=[SHELL]), state_dir=state_dir)
    assert msgspec.msgpack.decode(unsealed.dialect, type=FramerSpec).seal_with == ""
    assert msgspec.msgpack.decode(unsealed.dialect, type=FramerSpec).response.warnings is msgspec.UNSET


def _prompt(model_dir, request: CreateResponse, state_dir: str) -> str:
    """The prompt the chat core renders `request` to, as text (special tokens kept)."""
    cfg = ServerConfig(model="m", model_path=str(model_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=4096, postproc_workers=1)
    job = RenderJob("resp_1", "responses", msgspec.json.encode(RenderBody(request, state_dir=state_dir)), "ipc://x",
                    0.0)
    ids = bytes_to_ids(build_core(cfg).render(job).prompt_token_ids).tolist()
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def test_harmony_renders_the_opened_reasoning_as_the_turn_s_analysis_message(state_dir):
    blob = sealing.sealer(state_dir).seal(REASONING)
    text = _prompt(ensure_builtin("tiny-gpt-oss"), _codex(_turn({"encrypted_content": blob})), state_dir)
    assert f"<|start|>assistant<|channel|>analysis<|message|>{REASONING}<|end|>" in text
    assert "to=functions.mcp__weather__get_weather" in text and "web_search" not in text


def test_a_chat_template_renders_the_opened_reasoning_as_the_turn_s_reasoning(state_dir, tiny_chat_dir):
    blob = sealing.sealer(state_dir).seal(REASONING)
    text = _prompt(tiny_chat_dir, _codex(_turn({"encrypted_content": blob})), state_dir)
    assert f"<think>\n{REASONING}\n</think>" in text and '"name": "mcp__weather__get_weather"' in text
