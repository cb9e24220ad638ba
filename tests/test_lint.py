"""The codebase stays clean under ruff (pyflakes, pycodestyle) and mypy (the packages in pyproject.toml;
settings in pyproject.toml)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
    done = _run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean():
    done = _run("mypy", "--cache-dir", "/dev/null")
    assert done.returncode == 0, done.stdout + done.stderr
