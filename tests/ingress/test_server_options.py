from __future__ import annotations

import resource

import pytest
from granian.cli import cli as granian_cli

from sluice.app.cli import config_from_args, parse_args
from sluice.base.config import ServerConfig
from sluice.ingress.server_options import granian_args, raise_open_files_limit


def config(**kw) -> ServerConfig:
    return ServerConfig(model="m", model_path="/nonexistent", served_model_names=["m"], runtime_dir="/tmp/x", **kw)


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_max_pending_is_reached_before_the_connection_limit(tiny_chat_dir):
    cfg = config_from_args(parse_args(["serve", "--ingress-workers", "3"]))
    assert cfg.connection_limit > cfg.max_pending == 4096
    # granian's own default, --backlog / workers (1,024 connections in all), came first: --max-pending never applied
    per_worker = int(option(granian_args(cfg), "--backpressure"))
    assert per_worker * 3 >= cfg.connection_limit > 1024


def test_max_connections_follows_max_pending_unless_given(tiny_chat_dir):
    assert config_from_args(parse_args(["serve", "--max-pending", "100"])).connection_limit == 100 + 1024
    given = config_from_args(parse_args(["serve", "--max-pending", "100", "--max-connections", "300"]))
    assert given.connection_limit == 300
    with pytest.raises(ValueError, match="must exceed --max-pending"):
        config_from_args(parse_args(["serve", "--max-pending", "100", "--max-connections", "100"]))


@pytest.mark.parametrize("flags", [["--header-timeout", "0"], ["--header-timeout", "61"], ["--body-timeout", "0"],
                                   ["--body-timeout", "nan"]])
def test_timeouts_out_of_range_are_refused(flags, tiny_chat_dir):
    with pytest.raises(ValueError, match=flags[0]):
        config_from_args(parse_args(["serve", *flags]))


def test_granian_accepts_the_options():
    args = granian_args(config(ingress_workers=2, max_connections=1001, header_timeout=2.5))
    ctx = granian_cli.make_context("granian", [*args, "sluice.ingress.app:create_app"])
    assert (ctx.params["backpressure"], ctx.params["http1_header_read_timeout"]) == (501, 2500)
    assert ctx.params["http"].value == "1"  # auto mode reads the first bytes with no timeout at all


def test_the_open_files_limit_makes_room_for_the_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"hard open files limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        raise_open_files_limit(config(ingress_workers=2, max_connections=3000))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1500
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
