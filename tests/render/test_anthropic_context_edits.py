"""Anthropic's context editing and diagnostics at render: the edits drop the named blocks of earlier turns
from the prompt the model reads, and the framing tells the postproc what they cleared; diagnostics compare a
prompt with the one its previous message was answered from."""
from __future__ import annotations

import json

import msgspec
import pytest

from sluice.base.config import ServerConfig
from sluice.ipc.messages import PostprocSpec, RenderJob, bytes_to_ids
from sluice.render.context_edits import CLEARED_RESULT, apply, prompt_tokens
from sluice.render.worker import build_core
from sluice.schemas.anthropic import (CacheMiss, ClearedThinking, ClearedToolUses, ContextManagementResponse,
                                      Diagnostics, Framing, MessagesRequest, ToolUseBlock)
from tests.render.test_anthropic import ANTHROPIC_TOOLS

THINKING = "<think>\n{}\n</think>"


def _turn(k: int) -> list[dict]:
    """One user prompt answered after a tool call: thinking, a call, its result, thinking and an answer."""
    return [
        {"role": "user", "content": f"Question {k}?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": f"Plan {k}: call it.", "signature": "s"},
                                          {"type": "tool_use", "id": f"c{k}", "name": "get_weather",
                                           "input": {"city": f"City{k}"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"c{k}", "content": f"Result {k}"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": f"Answer {k} now.", "signature": "s"},
                                          {"type": "text", "text": f"Answer {k}."}]},
    ]


CONVERSATION = [m for k in range(1, 4) for m in _turn(k)] + [{"role": "user", "content": "Last question?"}]


@pytest.fixture(scope="module")
def core(tiny_chat_dir, tmp_path_factory):
    cfg = ServerConfig(model="m", model_path=str(tiny_chat_dir), served_model_names=["m"], runtime_dir="/tmp/x",
                       max_model_len=4096, tool_parser="hermes", reasoning_parser="think",
                       state_dir=str(tmp_path_factory.mktemp("state")))
    return build_core(cfg)


def render(core, request_id: str = "msg_1", **body) -> tuple[str, Framing]:
    """The prompt's text and the framing the postproc gets."""
    body = {"model": "m", "max_tokens": 16, "tools": ANTHROPIC_TOOLS, "messages": CONVERSATION, **body}
    r = core.render(RenderJob(request_id, "messages", json.dumps(body).encode(), "ipc://reply", 1000.0))
    spec = msgspec.msgpack.decode(r.postproc_spec, type=PostprocSpec)
    text = core.bundle.tokenizer.decode(bytes_to_ids(r.prompt_token_ids).tolist(), skip_special_tokens=False)
    return text, msgspec.msgpack.decode(spec.dialect, type=Framing)


def tokens(core, text: str) -> int:
    return len(core.bundle.tokenizer.encode(text, add_special_tokens=False).ids)


def edits(*edit: dict) -> dict:
    return {"context_management": {"edits": list(edit)}}


def test_without_edits_every_turn_keeps_its_thinking_and_tool_results(core):
    text, framing = render(core)
    assert all(f"Plan {k}: call it." in text and f"Result {k}" in text for k in (1, 2, 3))
    assert framing.context_management is None and framing.diagnostics is None


def test_clear_thinking_keeps_the_last_turns_thinking_and_says_what_it_cleared(core):
    text, framing = render(core, **edits({"type": "clear_thinking_20251015",
                                          "keep": {"type": "thinking_turns", "value": 1}}))
    assert not any(f"Plan {k}" in text or f"Answer {k} now." in text for k in (1, 2))
    assert "Plan 3: call it." in text and "Answer 3 now." in text
    assert all(f"Result {k}" in text and f"Answer {k}." in text for k in (1, 2, 3))  # (only the thinking goes)
    cleared = sum(tokens(core, t) for k in (1, 2) for t in (f"Plan {k}: call it.", f"Answer {k} now."))
    assert framing.context_management == ContextManagementResponse([ClearedThinking(2, cleared)])


def test_clear_thinking_by_default_keeps_one_turn_and_keeping_all_clears_nothing(core):
    default, framing = render(core, **edits({"type": "clear_thinking_20251015"}))
    assert "Plan 2" not in default and "Plan 3" in default
    assert framing.context_management.applied_edits[0].cleared_thinking_turns == 2
    for keep in ("all", {"type": "all"}):
        text, framing = render(core, **edits({"type": "clear_thinking_20251015", "keep": keep}))
        assert text == render(core)[0] and framing.context_management == ContextManagementResponse([])


def test_a_tool_loop_is_one_turn_whose_thinking_is_kept(core):
    """The thinking before a call and after its result belong to one turn: keep 1 keeps both."""
    text, _ = render(core, messages=CONVERSATION[:-1] + _turn(4)[:3],
                     **edits({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}))
    assert "Plan 4: call it." in text and "Plan 3" not in text and "Answer 3 now." not in text


def test_clear_tool_uses_replaces_all_but_the_last_results_once_triggered(core):
    text, framing = render(core, **edits({"type": "clear_tool_uses_20250919",
                                          "trigger": {"type": "tool_uses", "value": 2},
                                          "keep": {"type": "tool_uses", "value": 1}}))
    assert "Result 1" not in text and "Result 2" not in text and "Result 3" in text
    assert text.count(CLEARED_RESULT) == 2 and '"City1"' in text  # (inputs stay unless asked)
    assert framing.context_management == ContextManagementResponse(
        [ClearedToolUses(2, tokens(core, "Result 1") + tokens(core, "Result 2"))])


def test_clear_tool_uses_below_its_trigger_or_clear_at_least_clears_nothing(core):
    plain = render(core)[0]
    for edit in ({"trigger": {"type": "tool_uses", "value": 3}},  # (3 uses: not past it)
                 {},  # (the default trigger: 100,000 input tokens)
                 {"trigger": {"type": "tool_uses", "value": 0}, "clear_at_least": {"type": "input_tokens",
                                                                                  "value": 1000}}):
        text, framing = render(core, **edits({"type": "clear_tool_uses_20250919", **edit}))
        assert text == plain and framing.context_management == ContextManagementResponse([]), edit


def test_clear_tool_uses_inputs_exclusions_and_an_input_tokens_trigger(core):
    request = msgspec.json.decode(json.dumps({"model": "m", "max_tokens": 1, "tools": ANTHROPIC_TOOLS,
                                              "messages": CONVERSATION}), type=MessagesRequest)
    total = prompt_tokens(request, request.messages, lambda t: tokens(core, t))
    text, framing = render(core, **edits({"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 0},
                                          "trigger": {"type": "input_tokens", "value": total - 1},
                                          "clear_tool_inputs": True}))
    assert not any(f"Result {k}" in text or f"City{k}" in text for k in (1, 2, 3))
    assert framing.context_management.applied_edits[0].cleared_tool_uses == 3
    text, framing = render(core, **edits({"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 0},
                                          "trigger": {"type": "input_tokens", "value": total},
                                          "clear_tool_inputs": True}))
    assert "Result 1" in text and framing.context_management == ContextManagementResponse([])
    text, _ = render(core, **edits({"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 0},
                                    "trigger": {"type": "tool_uses", "value": 0},
                                    "exclude_tools": ["get_weather"]}))
    assert "Result 1" in text and CLEARED_RESULT not in text


def test_both_edits_apply_in_their_order(core):
    text, framing = render(core, **edits({"type": "clear_thinking_20251015"},
                                         {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses",
                                                                                          "value": 0}}))
    assert "Plan 2" not in text and "Result 3" in text and text.count(CLEARED_RESULT) == 0  # (keep 3: all 3 kept)
    assert [type(e) for e in framing.context_management.applied_edits] == [ClearedThinking]


def test_edits_leave_the_clients_request_as_sent():
    request = msgspec.json.decode(json.dumps({"model": "m", "max_tokens": 1, "messages": CONVERSATION, **edits(
        {"type": "clear_thinking_20251015"})}), type=MessagesRequest)
    edited = apply(request, len)
    assert request.messages[1].content[0].thinking == "Plan 1: call it."
    assert isinstance(edited.messages[1].content[0], ToolUseBlock)


# ---- diagnostics ---------------------------------------------------------------------------------------------

def test_diagnostics_say_nothing_for_an_appended_conversation_and_where_one_diverged(core):
    first = CONVERSATION[:5]
    assert render(core, "msg_d1", messages=first, diagnostics={"previous_message_id": None})[1].diagnostics is None
    appended = first + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More?"}]
    framing = render(core, "msg_d2", messages=appended, diagnostics={"previous_message_id": "msg_d1"})[1]
    assert framing.diagnostics is None
    changed = first[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                         "content": "Rain"}]}] + first[3:]
    miss = render(core, "msg_d3", messages=changed, diagnostics={"previous_message_id": "msg_d2"})[1].diagnostics
    assert miss is not None and miss.cache_miss_reason.type == "messages_changed"
    after = [m for m in appended[2:]]  # (the previous prompt's tokens from the changed message on)
    assert miss.cache_miss_reason.cache_missed_input_tokens == sum(
        tokens(core, t) for m in after for t in (
            [m["content"]] if isinstance(m["content"], str) else [
                b.get("text") or b.get("thinking") or b.get("content") for b in m["content"]]))


def test_diagnostics_name_the_part_that_changed_and_a_message_not_kept(core):
    body = dict(messages=CONVERSATION[:1], system="Be brief.")
    render(core, "msg_e1", diagnostics={"previous_message_id": None}, **body)
    for change, kind in (({"model": "m", "system": "Be long."}, "system_changed"),
                         ({"tools": ANTHROPIC_TOOLS * 0 or None}, "tools_changed"),
                         ({"thinking": {"type": "adaptive"}}, "unavailable")):
        miss = render(core, "msg_e2", diagnostics={"previous_message_id": "msg_e1"}, **{**body, **change})[1]
        assert miss.diagnostics is not None and miss.diagnostics.cache_miss_reason.type == kind, change
    gone = render(core, "msg_e3", diagnostics={"previous_message_id": "msg_nope"}, **body)[1]
    assert gone.diagnostics == Diagnostics(CacheMiss("previous_message_not_found"))
    # a message that did not ask for diagnostics is not kept
    render(core, "msg_e4", **body)
    assert render(core, "msg_e5", diagnostics={"previous_message_id": "msg_e4"}, **body)[1].diagnostics == \
        Diagnostics(CacheMiss("previous_message_not_found"))


@pytest.mark.parametrize("edits, words", [
    ([{"type": "clear_everything_20990101"}], "Invalid value 'clear_everything_20990101'"),
    ([{"type": "compact_20260112"}], "compact_20260112: server-side compaction"),
    ([{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}], "must be the first"),
    ([{"type": "clear_thinking_20251015", "keep": "some"}], "keep"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "turns", "value": 2}}], "'turns'"),
])
def test_an_edit_this_server_does_not_run_is_refused_naming_it(edits, words):
    body = {"model": "m", "max_tokens": 1, "messages": CONVERSATION, "context_management": {"edits": edits}}
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(json.dumps(body), type=MessagesRequest)
    assert words in str(e.value) and "$.context_management" in str(e.value)
