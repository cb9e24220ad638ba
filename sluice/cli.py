"""`sluice serve`: parse flags, resolve the model, run the supervisor."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from render.extensions import ExtensionOptions, check_parsers
from sluice import envs
from sluice.builtin_models import resolve_model
from sluice.config import ServerConfig, parse_size
from sluice.logs import setup_logging
from sluice.supervisor import Supervisor, make_runtime_dir

DEFAULT_MODEL = "builtin:tiny-chat"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="An OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="load generator: `sluice bench serve --help`, `sluice bench sweep --help`",
                   add_help=False)
    s = sub.add_parser("serve", help="serve a model over HTTP")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    s.add_argument("--model", help=f"checkpoint directory, HF hub id, or builtin:NAME (default {DEFAULT_MODEL})")
    s.add_argument("--served-model-name", nargs="+", help="the model id(s) clients use (default: --model as given)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--ingress-workers", type=_positive, default=1)
    s.add_argument("--render-workers", type=_positive, default=1)
    s.add_argument("--postproc-workers", type=_positive, default=1)
    s.add_argument("--max-model-len", type=_positive, help="context length (default: the checkpoint's)")
    s.add_argument("--max-num-seqs", type=_positive, default=256)
    s.add_argument("--max-num-batched-tokens", type=_positive, default=2048, help="token budget of one step")
    s.add_argument("--block-size", type=_positive, default=16)
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of earlier prompts")
    s.add_argument("--num-kv-blocks", type=_positive, help="KV cache size in blocks (overrides --kv-cache-memory)")
    s.add_argument("--kv-cache-memory", type=parse_size,
                   help="KV cache size in bytes, e.g. 2GiB (default 1GiB on CPU, 85%% of free memory on CUDA)")
    s.add_argument("--tool-parser", help="tool-call parser for chat output: hermes (generic), gpt_oss (gpt-oss)")
    s.add_argument("--reasoning-parser", help="reasoning parser for chat output: think (generic), gpt_oss (gpt-oss)")
    s.add_argument("--no-harmony", dest="harmony", action="store_false",
                   help="serve a gpt-oss checkpoint through its HF chat template, as text")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="allow a chat_template in requests (rendered in jinja2's sandbox)")
    s.add_argument("--runner", default="model", choices=["model", "replay"],
                   help="replay: emit recorded (or random) token ids instead of running the model")
    s.add_argument("--replay-file", help="JSONL of recorded token id sequences for --runner replay")
    s.add_argument("--replay-step-ms", type=float, default=0.0, help="simulated cost of a replay step")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--shm-threshold", type=parse_size, default=1 << 20,
                   help="payloads of at least this many bytes go through shared memory (see bench/RESULTS.md)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    s.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' on /v1 routes "
                   "(repeatable; also SLUICE_API_KEY, comma-separated)")
    s.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics and health too")
    s.add_argument("--max-request-bytes", type=parse_size, default=32 << 20, help="larger bodies get 413")
    s.add_argument("--request-timeout", type=float, default=0.0, help="per-request deadline in seconds (0: none)")
    s.add_argument("--max-pending", type=_positive, default=4096,
                   help="requests in flight before new ones get 503 with Retry-After")
    s.add_argument("--stall-timeout", type=float, default=2.0,
                   help="seconds without engine progress before /health and /ready report 503")
    s.add_argument("--stream-interval", type=_positive, default=1,
                   help="stream a frame every N tokens per request (the first token at once)")
    s.add_argument("--no-coalesce-frames", dest="coalesce_frames", action="store_false",
                   help="one SSE event per token (per --stream-interval tokens) even when the postproc falls "
                        "behind the engine (default: a request's tokens from steps that queued up go in one event)")
    s.add_argument("--perf-metrics", action="store_true",
                   help="add each request's stage timings to its response (the last chunk of a stream)")
    s.add_argument("--kv-timing-output", help="append one JSON line of timings per finished request to this file")
    s.add_argument("--log-format", choices=["text", "json"], default="text")
    s.add_argument("--config", help="YAML or TOML file with the same keys as these flags (flags win)")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    model = args.model or args.model_pos or DEFAULT_MODEL
    path = resolve_model(model)
    hf = json.loads((path / "config.json").read_text())
    check_parsers(hf, ExtensionOptions(args.tool_parser, args.reasoning_parser, args.harmony,
                                       args.trust_request_chat_template))
    max_len = args.max_model_len or hf.get("max_position_embeddings") or 4096
    cfg = ServerConfig(
        model=model,
        model_path=str(path),
        served_model_names=args.served_model_name or [model],
        runtime_dir=make_runtime_dir(),
        host=args.host,
        port=args.port,
        ingress_workers=args.ingress_workers,
        render_workers=args.render_workers,
        postproc_workers=args.postproc_workers,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.prefix_caching,
        num_kv_blocks=args.num_kv_blocks or 0,
        kv_cache_memory=args.kv_cache_memory or 0,
        dtype=args.dtype,
        device=args.device,
        runner=args.runner,
        replay_file=str(Path(args.replay_file).resolve()) if args.replay_file else None,
        replay_step_ms=args.replay_step_ms,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        harmony=args.harmony,
        trust_request_chat_template=args.trust_request_chat_template,
        shm_threshold=args.shm_threshold,
        shutdown_timeout=args.shutdown_timeout,
        api_keys=(args.api_key or []) + envs.api_keys(),
        protect_metrics=args.protect_metrics,
        max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout,
        max_pending=args.max_pending,
        stall_timeout=args.stall_timeout,
        perf_metrics=args.perf_metrics,
        stream_interval=args.stream_interval,
        coalesce_frames=args.coalesce_frames,
        kv_timing_output=str(Path(args.kv_timing_output).resolve()) if args.kv_timing_output else None,
        log_format=args.log_format,
    )
    return cfg


def load_config_file(path: str) -> dict:
    """A YAML or TOML file of flag values, keyed by flag name (dashes or underscores)."""
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        serve = parser._subparsers._group_actions[0].choices["serve"]
        values = load_config_file(args.config)
        known = {a.dest for a in serve._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{args.config}: unknown settings {unknown}")
        if "model" in values and args.model_pos is None:
            values.setdefault("model_pos", None)
        serve.set_defaults(**values)  # the file's values become defaults: flags on the command line win
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the load generator has its own flags
        from bench.serve import main as bench_main

        return bench_main(argv[1:])
    try:
        args = parse_args(argv)
    except (ValueError, OSError) as e:
        sys.exit(f"sluice: {e}")
    setup_logging("sluice", args.log_format)
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"sluice: {e}")
    sys.exit(Supervisor(cfg).run())


if __name__ == "__main__":
    main()
