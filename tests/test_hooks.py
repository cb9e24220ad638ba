"""--request-hook and --post-processor-hook: loading a hook, and what a hook may and may not give back
(sluice/base/hooks.py), with deploy/hooks_example.py's hooks as the examples the docs point at."""
from __future__ import annotations

from pathlib import Path

import pytest

from sluice.base import hooks
from sluice.base.hooks import HookError, OutputChunk, Refused, RenderedRequest
from sluice.ipc.messages import SamplingParams

EXAMPLE = str(Path(__file__).resolve().parents[1] / "deploy" / "hooks_example.py")


def rendered(user: str | None = None, **sampling) -> RenderedRequest:
    return RenderedRequest("r1", "chat", "m", user, [1, 2, 3], SamplingParams(max_tokens=100, **sampling), 256)


def chunk(text: str, final: bool = False, rid: str = "r1") -> OutputChunk:
    return OutputChunk(rid, 0, text, text, 7, final)


def test_a_class_is_made_once_and_a_function_is_taken_as_it_is():
    guard = hooks.load(f"{EXAMPLE}:BannedPhraseGuard", "--post-processor-hook")
    assert type(guard).__name__ == "BannedPhraseGuard" and guard.seen == {}
    upper = hooks.load(f"{EXAMPLE}:upper_case", "--post-processor-hook")
    assert upper(chunk("hi")) == hooks.emit("HI")


@pytest.mark.parametrize("spec, why", [("nocolon", "give module:name"), (f"{EXAMPLE}:missing", "no callable"),
                                       ("no_such_module_anywhere:f", "cannot load"),
                                       (f"{EXAMPLE}:MAX_TEMPERATURE", "no callable")])
def test_a_spec_that_names_no_hook_fails_the_start_naming_its_flag(spec, why):
    with pytest.raises(ValueError, match=why) as e:
        hooks.checked(spec, "--request-hook")
    assert str(e.value).startswith("--request-hook")


def test_checked_makes_a_files_path_absolute(monkeypatch):
    monkeypatch.chdir(Path(EXAMPLE).parents[1])
    assert hooks.checked("deploy/hooks_example.py:cap_sampling", "--request-hook") == f"{EXAMPLE}:cap_sampling"
    assert hooks.checked("json:dumps", "--request-hook") == "json:dumps"  # (a module stays a module)


def test_the_example_request_hook_refuses_a_hot_temperature_and_caps_a_trial_user():
    cap = hooks.load(f"{EXAMPLE}:cap_sampling", "--request-hook")
    with pytest.raises(Refused, match="temperature 1.9 is above this server's limit of 1.5"):
        hooks.hooked_sampling(cap, rendered(temperature=1.9))
    assert hooks.hooked_sampling(cap, rendered("trial", min_tokens=50)) == SamplingParams(max_tokens=4, min_tokens=4)
    plain = rendered("someone", temperature=0.5)
    assert hooks.hooked_sampling(cap, plain) is plain.sampling


@pytest.mark.parametrize("changes, why", [
    ({"stop_token_ids": [1]}, r"may change only .* not \['stop_token_ids'\]"),
    ({"max_tokens": 254}, r"max_tokens 254 not in \[1, 253\]"),  # 256 - 3 prompt tokens
    ({"temperature": -1.0}, "temperature below 0"),
    ({"top_p": 0.0}, r"top_p not in \(0, 1\]"),
    ({"temperature": "hot"}, "Expected `float`"),
    (["max_tokens"], "returned a list"),
])
def test_what_a_request_hook_may_not_give_back_is_the_hooks_fault(changes, why):
    with pytest.raises(HookError, match=why):
        hooks.hooked_sampling(lambda r: changes, rendered())


def test_a_request_hook_that_raises_is_the_hooks_fault_and_one_that_refuses_is_the_clients():
    def broken(r):
        raise KeyError("oops")

    with pytest.raises(HookError, match="the request hook failed: KeyError"):
        hooks.hooked_sampling(broken, rendered())

    def refuses(r):
        raise Refused("not today")

    with pytest.raises(Refused, match="not today"):
        hooks.hooked_sampling(refuses, rendered())


def test_a_post_processor_verdict_must_be_one_of_the_three():
    assert hooks.vetted(lambda c: hooks.suppress(), chunk("x")) == hooks.Suppress()
    assert hooks.vetted(lambda c: hooks.terminate("why"), chunk("x")) == hooks.Terminate("why")
    for bad in (lambda c: c.text_diff, lambda c: None, lambda c: hooks.Emit(3)):
        with pytest.raises(HookError, match="return emit"):
            hooks.vetted(bad, chunk("x"))


def test_the_example_guard_ends_a_choice_at_a_phrase_split_across_chunks_and_forgets_it():
    guard = hooks.load(f"{EXAMPLE}:BannedPhraseGuard", "--post-processor-hook")
    assert guard(chunk("the sword")) == hooks.emit("the sword")
    assert guard(chunk("FISH is")) == hooks.terminate("banned phrase")
    assert guard.seen == {}
    assert guard(chunk("fish", final=True, rid="r2")) == hooks.emit("fish") and guard.seen == {}


def test_the_post_processor_hook_is_refused_at_start_where_harmony_reads_the_tokens(tiny_chat_dir):
    import shutil

    from sluice.app.cli import config_from_args, parse_args

    hook = ["--post-processor-hook", f"{EXAMPLE}:upper_case"]
    with pytest.raises(ValueError, match="cannot apply to a gpt-oss model served through harmony"):
        config_from_args(parse_args(["serve", "builtin:tiny-gpt-oss", *hook]))
    cfg = config_from_args(parse_args(["serve", "builtin:tiny-gpt-oss", "--no-harmony", *hook,
                                       "--request-hook", "deploy/hooks_example.py:cap_sampling"]))
    shutil.rmtree(cfg.runtime_dir)
    assert (cfg.post_processor_hook, cfg.request_hook) == (f"{EXAMPLE}:upper_case", f"{EXAMPLE}:cap_sampling")
    assert cfg.output_mode == "text"  # (the extension's: gpt-oss as text)
    with pytest.raises(ValueError, match="--request-hook 'deploy/nothing.py:f': cannot load"):
        config_from_args(parse_args(["serve", "--request-hook", "deploy/nothing.py:f"]))
    with pytest.raises(ValueError, match="--otlp-traces-endpoint 'collector:4318': give an http"):
        config_from_args(parse_args(["serve", "--otlp-traces-endpoint", "collector:4318"]))
