"""deploy/sluice.service: the service user has no home, so the unit gives Sluice a cache and a state
directory of its own (systemd creates them, owned by User=) and points Sluice at them."""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "sluice.service"


def _settings(text: str) -> dict[str, list[str]]:
    """`Section.Key` -> every value it is given, in order (systemd allows a key more than once)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, value = line.split("=", 1)
            settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def _environment(settings: dict[str, list[str]]) -> dict[str, str]:
    """What the Environment= lines set (each holds one or more quoted KEY=VALUE words)."""
    return dict(word.split("=", 1) for value in settings.get("Service.Environment", []) for word in shlex.split(value))


def test_the_unit_gives_sluice_a_cache_and_a_state_directory_and_points_it_there():
    settings = _settings(UNIT.read_text())
    env = _environment(settings)
    assert settings["Service.CacheDirectory"] == ["sluice"]
    assert settings["Service.StateDirectory"] == ["sluice"]
    assert env["SLUICE_CACHE_DIR"] == "/var/cache/sluice"
    assert env["SLUICE_STATE_DIR"] == "/var/lib/sluice"
    assert env["HF_HOME"].startswith("/var/cache/sluice/")  # downloaded checkpoints: no home to put them in


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path):
    unit = tmp_path / "sluice.service"  # (ExecStart's binary must exist for verify: /bin/true stands in)
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/sluice serve", "/bin/true"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
