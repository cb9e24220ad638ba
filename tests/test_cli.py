from __future__ import annotations

import pytest

from sluice.app.cli import config_from_args, parse_args


def test_config_file_values_are_defaults_and_flags_win(tmp_path, tiny_chat_dir):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("port: 9001\nmax-num-seqs: 7\napi_key: [a, b]\nrequest_timeout: 5\nno-prefix-caching: true\n"
                    "kv_cache_memory: 2GiB\n")
    cfg = config_from_args(parse_args(["serve", "--config", str(yaml), "--port", "9002"]))
    assert (cfg.port, cfg.max_num_seqs, cfg.api_keys, cfg.request_timeout) == (9002, 7, ["a", "b"], 5)
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_memory == 2 << 30
    toml = tmp_path / "c.toml"
    toml.write_text('port = 9003\nmodel = "builtin:tiny-chat"\nenable_prefix_caching = false\n')
    cfg = config_from_args(parse_args(["serve", "--config", str(toml)]))
    assert (cfg.port, cfg.model, cfg.enable_prefix_caching) == (9003, "builtin:tiny-chat", False)


def test_flags_set_what_they_name_and_the_rest_keep_their_defaults(tiny_chat_dir):
    cfg = config_from_args(parse_args(["serve", "builtin:tiny-chat", "--no-prefix-caching", "--perf-metrics",
                                       "--kv-cache-memory", "64MiB", "--served-model-name", "a", "b",
                                       "--api-key", "k1", "--api-key", "k2", "--dtype", "bfloat16"]))
    assert (cfg.enable_prefix_caching, cfg.perf_metrics, cfg.kv_cache_memory) == (False, True, 64 << 20)
    assert (cfg.served_model_names, cfg.api_keys, cfg.dtype) == (["a", "b"], ["k1", "k2"], "bfloat16")
    assert cfg.max_model_len == 4096 and cfg.model_path.endswith("tiny-chat-v1") and cfg.runtime_dir
    assert (cfg.max_num_seqs, cfg.harmony, cfg.coalesce_frames) == (256, True, True)


@pytest.mark.parametrize("flags, message", [(["--max-num-seqs", "0"], "--max-num-seqs: expected `int` >= 1"),
                                            (["--port", "70000"], "--port"),
                                            (["--stall-timeout", "0"], "--stall-timeout")])
def test_values_out_of_bounds_name_their_flag(flags, message, tiny_chat_dir):
    with pytest.raises(ValueError, match=message):
        config_from_args(parse_args(["serve", *flags]))


def test_the_docs_flag_table_is_the_options_own():
    """Each option is defined once (sluice/config.py); docs/flags.md's table is printed by `sluice flags`."""
    from pathlib import Path

    from sluice.base.options import flag_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "flags.md").read_text()
    start = doc.index("<!-- flags: begin -->\n") + len("<!-- flags: begin -->\n")
    assert doc[start:doc.index("<!-- flags: end -->")] == flag_table(), \
        "docs/flags.md's flag table drifted: replace it with the output of `sluice flags`"


def test_unknown_config_keys_are_errors(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown settings"):
        parse_args(["serve", "--config", str(bad)])


def test_api_keys_from_flags_and_environment(monkeypatch, tiny_chat_dir):
    monkeypatch.setenv("SLUICE_API_KEY", "env1,env2")
    cfg = config_from_args(parse_args(["serve", "--api-key", "flag"]))
    assert cfg.api_keys == ["flag", "env1", "env2"]
    assert config_from_args(parse_args(["serve"])).api_keys == ["env1", "env2"]


def test_a_parser_that_cannot_apply_fails_at_startup(tiny_chat_dir):
    with pytest.raises(ValueError, match="cannot apply"):
        config_from_args(parse_args(["serve", "--tool-parser", "gpt_oss"]))


def test_runtime_directory_is_private():
    import os
    import shutil
    import stat

    from sluice.app.supervisor import make_runtime_dir

    path = make_runtime_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        shutil.rmtree(path)


def test_front_stage_workers_default_to_the_core_count(monkeypatch):
    from sluice.base.config import ServerConfig

    for cores, want in ((2, 1), (8, 1), (16, 2), (64, 2)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        cfg = ServerConfig()
        assert (cfg.ingress_workers, cfg.render_workers, cfg.postproc_workers) == (want, want, want)
        assert ServerConfig(ingress_workers=3, postproc_workers=1).ingress_workers == 3


def test_a_max_model_len_past_the_rotary_table_is_refused_at_start(tiny_chat_dir):
    """A context longer than the checkpoint's max_position_embeddings reads past its rotary table: refused at
    start naming both, not a 500 (or a dead engine) on the first long prompt. The replay runner has no table."""
    with pytest.raises(ValueError, match="--max-model-len 8192 is beyond the model's max_position_embeddings"):
        config_from_args(parse_args(["serve", "--model", str(tiny_chat_dir), "--max-model-len", "8192"]))
    assert config_from_args(parse_args(["serve", "--model", str(tiny_chat_dir), "--max-model-len", "4096"])) \
        .max_model_len == 4096
    replay = parse_args(["serve", "--model", str(tiny_chat_dir), "--max-model-len", "8192", "--runner", "replay"])
    assert config_from_args(replay).max_model_len == 8192
