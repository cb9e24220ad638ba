"""Claude Code's current release (`claude -p`, pointed at Sluice with ANTHROPIC_BASE_URL as docs/dialects.md
says) completes a task against Sluice: its first request (its default system prompt and tools, adaptive
thinking, context_management clearing thinking, output_config.effort, metadata, its betas) is answered with a
call to its Bash tool, which it runs, and its second request, which sends the thinking, the call and its result
back, with the answer. The model is builtin:tiny-chat replaying those two turns; the replay runner keeps no KV,
so a --max-model-len past the tiny model's positions takes Claude Code's whole prompt (~56k of its tokens).

Runs where the CLI is installed (`npm install -g @anthropic-ai/claude-code`, or SLUICE_CLAUDE_BIN naming its
binary); it skips, saying so, where it is not."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from bench.server import Server
from tests.e2e.test_anthropic import recording

CLAUDE = os.environ.get("SLUICE_CLAUDE_BIN") or shutil.which("claude")
pytestmark = pytest.mark.skipif(CLAUDE is None, reason="the Claude Code CLI is not installed (npm install -g "
                                                       "@anthropic-ai/claude-code, or set SLUICE_CLAUDE_BIN)")
MODEL = "builtin:tiny-chat"
CALLING = ('<think>I should run a command to check the weather.</think><tool_call>\n{"name": "Bash", "arguments": '
           '{"command": "echo sunny", "description": "Print the weather"}}\n</tool_call>')
ANSWERING = "<think>The command said sunny.</think>It is sunny in Paris."


def test_claude_p_completes_a_task_that_runs_a_command(tmp_path, tmp_path_factory, tiny_chat_dir):
    replay = tmp_path / "claude.jsonl"
    replay.write_text("\n".join(open(recording(tmp_path_factory, tiny_chat_dir, turn)).read()
                                for turn in (CALLING, ANSWERING)))
    server = Server("--model", MODEL, "--runner", "replay", "--replay-file", str(replay), "--max-model-len", "131072",
                    "--num-kv-blocks", "16384", "--reasoning-parser", "think", "--tool-parser", "hermes",
                    "--api-key", "sk-claude", "--state-dir", str(tmp_path / "state"))
    home = tmp_path / "home"
    home.mkdir()
    try:
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-claude",
               # (its session title is asked of the model too, at a moment of its own: off, so that each
               # recorded turn answers the request it was recorded for)
               "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        done = subprocess.run([CLAUDE, "-p", "Weather in Paris?", "--model", MODEL, "--allowedTools", "Bash",
                               "--output-format", "json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(done.stdout)
        assert (result["is_error"], result["result"], result["num_turns"]) == (False, "It is sunny in Paris.", 2)
        [transcript] = home.glob(".claude/projects/*/*.jsonl")
        blocks = [b for line in transcript.read_text().splitlines()
                  for b in (json.loads(line).get("message") or {}).get("content") or [] if isinstance(b, dict)]
        [call] = [b for b in blocks if b["type"] == "tool_use"]
        [ran] = [b for b in blocks if b["type"] == "tool_result"]
        assert (call["name"], call["input"]["command"]) == ("Bash", "echo sunny")
        assert ran["tool_use_id"] == call["id"] and "sunny" in str(ran["content"]) and not ran.get("is_error")
    finally:
        assert server.stop() == 0, server.output()
    log = server.output()
    assert log.count("endpoint=messages status=200") == 2 and "request refused" not in log, log
