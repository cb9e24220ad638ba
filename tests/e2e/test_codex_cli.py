"""Codex's current release (`codex exec` with a custom provider, wire_api "responses") completes a task against
Sluice: its first request (sealed reasoning asked for, store: false, function, namespace and web_search tools)
is answered with a call to its exec_command tool, which Codex runs, and its second request, which sends the
reasoning back sealed, with the answer. The model is tiny-gpt-oss replaying those two turns.

Runs where the CLI is installed (`npm install -g @openai/codex`, or SLUICE_CODEX_BIN naming its binary); it
skips, saying so, where it is not."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from bench.server import Server
from tests.harmony_outputs import harmony_tokens

CODEX = os.environ.get("SLUICE_CODEX_BIN") or shutil.which("codex")
pytestmark = pytest.mark.skipif(CODEX is None, reason="the Codex CLI is not installed (npm install -g @openai/codex, "
                                                      "or set SLUICE_CODEX_BIN)")
MODEL = "builtin:tiny-gpt-oss"
CALLING = [("analysis", "I should run a command to check the weather."),
           ("call", "exec_command", {"cmd": "echo sunny"})]
ANSWERING = [("analysis", "The command said sunny."), ("final", "It is sunny in Paris.")]


def test_codex_exec_completes_a_task_that_runs_a_command(tmp_path):
    replay = tmp_path / "codex.jsonl"
    replay.write_text("\n".join(json.dumps(harmony_tokens(turn)) for turn in (CALLING, ANSWERING)))
    server = Server("--model", MODEL, "--max-model-len", "32768", "--runner", "replay", "--replay-file", str(replay),
                    "--state-dir", str(tmp_path / "state"))
    try:
        home = tmp_path / "codex"
        home.mkdir()
        (home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "sluice"\n\n[model_providers.sluice]\nname = "sluice"\n'
            f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "SLUICE_TEST_KEY"\n'
            'request_max_retries = 0\nstream_max_retries = 0\n')
        done = subprocess.run([CODEX, "exec", "--skip-git-repo-check", "Weather in Paris?"], cwd=tmp_path,
                              env={**os.environ, "CODEX_HOME": str(home), "SLUICE_TEST_KEY": "x"},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "It is sunny in Paris." in done.stdout, done.stdout + done.stderr
        [rollout] = home.glob("sessions/**/*.jsonl")
        items = [json.loads(line).get("payload", {}) for line in rollout.read_text().splitlines()]
        reasoning = [item for item in items if item.get("type") == "reasoning"]
        assert len(reasoning) == 2 and all(item["encrypted_content"].startswith("v1.") for item in reasoning)
    finally:
        assert server.stop() == 0, server.output()
    log = server.output()
    assert log.count("endpoint=responses status=200") == 2, log
    assert "(type 'web_search') was left out of the prompt" in log  # (and each response's `warnings` say so)
