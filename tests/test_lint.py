"""The codebase stays clean under ruff (pyflakes, pycodestyle) and mypy (the packages in pyproject.toml;
settings in pyproject.toml)."""
from __future__ import annotations

import ast
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


# The layers under sluice/, lowest first: a module imports only from its own layer or a lower one (the stages
# render, engine and postproc not from each other), at module level or inside a function alike.
LAYERS = {"schemas": 0, "ipc": 1, "base": 2, "state": 2, "render": 3, "engine": 3, "postproc": 3, "ingress": 4,
          "router": 5, "app": 5}


def _sluice_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "sluice" and len(parts) > 1 and parts[1] in LAYERS:
                yield node.lineno, name, parts[1]


def test_imports_run_one_way():
    packages = {p.name for p in (ROOT / "sluice").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), f"a package under sluice/ with no layer: {packages ^ set(LAYERS)}"
    upward = []
    for path in (ROOT / "sluice").rglob("*.py"):
        rel = path.relative_to(ROOT)
        if len(rel.parts) < 3:
            continue
        own = rel.parts[1]
        for line, name, target in _sluice_imports(path):
            if LAYERS[target] > LAYERS[own] or (LAYERS[target] == LAYERS[own] == 3 and target != own):
                upward.append(f"{rel}:{line} imports {name}")
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)
