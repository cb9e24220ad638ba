from __future__ import annotations

import pytest

from sluice.cli import config_from_args, parse_args


def test_config_file_values_are_defaults_and_flags_win(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("port: 9001\nmax-num-seqs: 7\napi_key: [a, b]\nrequest_timeout: 5\n")
    args = parse_args(["serve", "--config", str(yaml), "--port", "9002"])
    assert (args.port, args.max_num_seqs, args.api_key, args.request_timeout) == (9002, 7, ["a", "b"], 5)
    toml = tmp_path / "c.toml"
    toml.write_text('port = 9003\nmodel = "builtin:tiny-chat"\n')
    args = parse_args(["serve", "--config", str(toml)])
    assert (args.port, args.model) == (9003, "builtin:tiny-chat")


def test_unknown_config_keys_are_errors(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown settings"):
        parse_args(["serve", "--config", str(bad)])


def test_api_keys_from_flags_and_environment(monkeypatch, tiny_chat_dir):
    monkeypatch.setenv("SLUICE_API_KEY", "env1,env2")
    cfg = config_from_args(parse_args(["serve", "--api-key", "flag"]))
    assert cfg.api_keys == ["flag", "env1", "env2"]


def test_a_parser_that_cannot_apply_fails_at_startup():
    with pytest.raises(ValueError, match="cannot apply"):
        config_from_args(parse_args(["serve", "--tool-parser", "gpt_oss"]))


def test_runtime_directory_is_private():
    import os
    import shutil
    import stat

    from sluice.supervisor import make_runtime_dir

    path = make_runtime_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        shutil.rmtree(path)
