"""`sluice serve`: parse flags, resolve the model, run the supervisor."""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import msgspec

from sluice import state
from sluice.app.builtin_models import resolve_model
from sluice.app.supervisor import Supervisor, make_runtime_dir
from sluice.base import envs, hooks, ports, sealing, tracing
from sluice.base.checkpoint import sampling_defaults
from sluice.base.config import ServerConfig
from sluice.base.disagg import check_role
from sluice.base.logs import setup_logging
from sluice.base.options import add_flags, config_file_values, flag_table, validated
from sluice.engine import gptq_config
from sluice.ingress import grpc as grpc_door
from sluice.ingress import middleware
from sluice.render.extensions import ServingExtension, extension_class, options_of
from sluice.render.tokenizer import chat_template

log = logging.getLogger("sluice")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="An OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="load generator: `sluice bench serve --help`, `sluice bench sweep --help`",
                   add_help=False)
    sub.add_parser("flags", help="print the table of `sluice serve` flags (docs/flags.md)")
    sub.add_parser("router", help="KV-cache-aware router over Sluice servers: `sluice router --help`",
                   add_help=False)
    s = sub.add_parser("serve", help="serve a model over HTTP")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    s.add_argument("--config", help="YAML or TOML file with the same keys as these flags (flags win)")
    add_flags(s)
    return parser


def load_config_file(path: str) -> dict:
    """A YAML or TOML file of settings, as field values."""
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    return config_file_values(data, path)


def parse_args(argv: list[str] | None) -> dict:
    """The settings given: a --config file's, then the command line's over them (the defaults fill the
    rest later)."""
    args = vars(build_parser().parse_args(argv))
    if args.get("command") != "serve":
        return args
    values = load_config_file(args.pop("config")) if args.get("config") else {}
    args.pop("config", None)
    positional = args.pop("model_pos", None)
    if positional is not None and "model" not in args:
        args["model"] = positional
    return {**values, **args}


def config_from_args(args: dict) -> ServerConfig:
    """The whole configuration: the settings given over the defaults, with what is worked out at startup
    (the checkpoint, its context length, the runtime directory), checked once."""
    values = {k: v for k, v in args.items() if k != "command"}
    values["api_keys"] = list(values.get("api_keys", [])) + envs.api_keys()
    values.setdefault("disagg_secret", envs.disagg_secret())
    cfg = validated(values)
    path = resolve_model(cfg.model)
    hf = json.loads((path / "config.json").read_text())
    if cfg.runner == "model":  # a quantization_config it cannot read: refused (naming the field) before any process
        gptq_config.scheme(hf)
    if cfg.grpc_port is not None:
        grpc_door.check_options(cfg.tool_parser, cfg.reasoning_parser)
    extension = extension_class(hf, options_of(cfg))
    extension.check_options(options_of(cfg))
    cfg = msgspec.structs.replace(
        cfg,
        model_path=str(path),
        served_model_names=cfg.served_model_names or [cfg.model],
        max_model_len=cfg.max_model_len or hf.get("max_position_embeddings") or 4096,
        replay_file=str(Path(cfg.replay_file).resolve()) if cfg.replay_file else None,
        kv_timing_output=str(Path(cfg.kv_timing_output).resolve()) if cfg.kv_timing_output else None,
        state_dir=str(Path(cfg.state_dir or envs.state_dir()).resolve()),
        middleware=[middleware.checked(spec) for spec in cfg.middleware],
        request_hook=hooks.checked(cfg.request_hook, "--request-hook") if cfg.request_hook else None,
        post_processor_hook=checked_post_processor_hook(cfg, extension),
        output_mode=extension.output_mode,
    )
    if cfg.chat_template is not None:  # (checked now; a file is read by each render worker, as it is then)
        chat_template(path, cfg.chat_template)
        cfg = msgspec.structs.replace(cfg, chat_template=str(Path(cfg.chat_template).resolve())
                                      if Path(cfg.chat_template).is_file() else cfg.chat_template)
    if defaults := sampling_defaults(cfg.model_path, cfg.generation_config):
        log.info("sampling defaults (--generation-config %s; a request's own values win): %s", cfg.generation_config,
                 ", ".join(f"{k} {v:g}" for k, v in defaults.items()))
    positions = hf.get("max_position_embeddings")
    if cfg.runner == "model" and positions and cfg.max_model_len > positions:
        raise ValueError(f"--max-model-len {cfg.max_model_len} is beyond the model's max_position_embeddings "
                         f"({positions}): its rotary table ends there; give at most {positions}")
    if cfg.connection_limit <= cfg.max_pending:
        raise ValueError(f"--max-connections ({cfg.connection_limit}) must exceed --max-pending ({cfg.max_pending}): "
                         f"each pending request holds a connection, and a full server needs more to answer 503")
    return msgspec.structs.replace(cfg, runtime_dir=make_runtime_dir())


def checked_post_processor_hook(cfg: ServerConfig, extension: type[ServingExtension]) -> str | None:
    """--post-processor-hook once it loads, where it can apply; and --otlp-traces-endpoint checked with it."""
    if cfg.otlp_traces_endpoint:
        tracing.traces_url(cfg.otlp_traces_endpoint)
        if not tracing.available():
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry's SDK and its OTLP/HTTP exporter: pip "
                             "install 'sluice[tracing]'")
    if not cfg.post_processor_hook:
        return None
    if extension.post_processor_hook_refusal is not None:
        raise ValueError(f"--post-processor-hook cannot apply to {extension.post_processor_hook_refusal}")
    return hooks.checked(cfg.post_processor_hook, "--post-processor-hook")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the load generator has its own flags
        from bench.serve import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["router"]:  # so has the router
        from sluice.router.cli import main as router_main

        return router_main(argv[1:])
    try:
        args = parse_args(argv)
    except (ValueError, OSError) as e:
        sys.exit(f"sluice: {e}")
    if args["command"] == "flags":
        return print(flag_table(), end="")
    setup_logging("sluice", args.get("log_format", "text"))
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"sluice: {e}")
    try:
        if cfg.sealing_key_file:
            sealing.share(cfg.sealing_key_file)
    except OSError as e:
        sys.exit(f"sluice: --sealing-key-file: {e}")
    try:
        state.check_dir(cfg, given="state_dir" in args)
        check_role(cfg)
        http = ports.hold(cfg.host, cfg.port)
        cfg = msgspec.structs.replace(cfg, port=http.getsockname()[1])
        if (door := grpc_door.hold_port(cfg.host, cfg.grpc_port)) is not None:  # (held as long as `http` is)
            cfg = msgspec.structs.replace(cfg, grpc_port=door.getsockname()[1])
    except (OSError, ValueError) as e:
        shutil.rmtree(cfg.runtime_dir, ignore_errors=True)
        sys.exit(f"sluice: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}" if isinstance(e, OSError)
                 else f"sluice: {e}")
    sys.exit(Supervisor(cfg, http).run())


if __name__ == "__main__":
    main()
