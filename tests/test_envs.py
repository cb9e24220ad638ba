"""sluice/envs.py: the directories and the compiler command Sluice reads from the environment."""
from __future__ import annotations

from pathlib import Path

import pytest

from sluice.base import envs


def test_the_state_directory_is_sluice_state_dir_else_the_xdg_state_home_else_local_state(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert envs.state_dir() == tmp_path / ".local" / "state" / "sluice"
    monkeypatch.setenv("XDG_STATE_HOME", "/xdg/state")
    assert envs.state_dir() == Path("/xdg/state/sluice")
    monkeypatch.setenv("SLUICE_STATE_DIR", "/var/lib/sluice")
    assert envs.state_dir() == Path("/var/lib/sluice")


@pytest.mark.parametrize("cc, command", [(None, None), ("", None), ("  ", None), ("gcc", ["gcc"]),
                                         ("ccache gcc", ["ccache", "gcc"]),
                                         ("'/opt/my cc/gcc' -m64", ["/opt/my cc/gcc", "-m64"])])
def test_cc_is_split_as_a_shell_splits_a_command_line(monkeypatch, cc, command):
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    assert envs.c_compiler() == command
