"""The state directory at startup (issue 37): one that cannot be used fails the server, naming it, when it was
given; one only defaulted to is a warning (a server with nowhere to write still serves). The check leaves
nothing behind."""
from __future__ import annotations

import logging
import os
import sqlite3

import pytest

from sluice import state
from sluice.app.cli import main
from sluice.base.config import ServerConfig


def _cfg(path) -> ServerConfig:
    return ServerConfig(model="m", state_dir=str(path))


def test_a_directory_that_can_hold_the_database_has_no_problem_and_is_left_as_it_was(tmp_path):
    assert state.problem(str(tmp_path)) is None
    assert state.problem(str(tmp_path / "not" / "yet")) is None
    assert list(tmp_path.iterdir()) == []  # (nothing made: a server that never stores makes no database)
    with sqlite3.connect(tmp_path / "sluice.sqlite3") as db:
        db.execute("CREATE TABLE t (x)")
    assert state.problem(str(tmp_path)) is None


def test_what_makes_a_state_directory_unusable_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    assert "is not a directory" in state.problem(str(tmp_path / "file" / "state"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sluice.sqlite3").write_bytes(b"\xff" * 4096)
    assert "sluice.sqlite3: file is not a database" in state.problem(str(broken))
    (tmp_path / "dir-db").mkdir()
    (tmp_path / "dir-db" / "sluice.sqlite3").mkdir()
    assert "sluice.sqlite3" in state.problem(str(tmp_path / "dir-db"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes where the modes say it cannot")
def test_a_directory_this_user_cannot_write_is_unusable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert state.problem(str(locked)) and state.problem(str(locked / "state"))


def test_a_given_unusable_state_dir_fails_the_start_naming_it(tmp_path, tiny_chat_dir):
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "state"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tiny_chat_dir), "--state-dir", str(where)])
    assert str(e.value.code).startswith(f"sluice: --state-dir {where} cannot be used: ")


def test_a_defaulted_unusable_state_dir_is_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, "sluice.state.database"):
        state.check_dir(_cfg(tmp_path / "file" / "state"), given=False)
    assert "cannot be used" in caplog.text and "set --state-dir" in caplog.text
    with pytest.raises(ValueError, match="cannot be used"):
        state.check_dir(_cfg(tmp_path / "file" / "state"), given=True)
