"""The server's configuration: one frozen Struct, validated once at startup and
handed to every process (as a JSON file for the granian-started ingress).

Each option is defined here once: its name, type, default, bounds and help.
The command line (`sluice serve --help`), `--config` files and docs/flags.md's
flag table are all derived from these fields (sluice/cli.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from sluice.base.affinity import allowed_cpus
from sluice.ipc.addresses import Addresses

# Connections beyond --max-pending by default: health checks, /metrics, and the 503s of a full server need one each.
CONNECTION_HEADROOM = 1024
HEADER_TIMEOUT_MAX_S = 60.0  # granian's upper bound on --http1-header-read-timeout


def option(help: str, *, flag: str | None = None, unit: Literal["bytes", "s", "ms"] | None = None,
           default_text: str | None = None, derived: bool = False, **bounds) -> Meta:
    """An option's metadata: help, bounds (ge=, le=, ...), and how the command line shows it: `flag`
    (default --field-name; for a bool that defaults to True, the --no-... flag that turns it off), `unit`
    (bytes accept 512MiB, 2GiB), `default_text` (a default that is worked out at startup), `derived`
    (set at startup, never by the user)."""
    extra = {k: v for k, v in dict(flag=flag, unit=unit, default_text=default_text, derived=derived).items() if v}
    return Meta(description=help, extra=extra, **bounds)


Count = Annotated[int, Meta(ge=1)]
AUTO_WORKERS = "1; 2 on 16 or more cores"


def auto_workers() -> int:
    """Processes of each front stage for this machine's cores. Each is one single-threaded Python process with
    a core's worth of work at the pipeline's ceiling; a second one of each halves their load where cores are
    plenty, and where they are few costs more than it gives (bench/RESULTS.md#front-stage-workers)."""
    return 2 if len(allowed_cpus()) >= 16 else 1


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, option("checkpoint directory, Hugging Face hub id, or builtin:NAME (also the first "
                                 "positional argument)")] = "builtin:tiny-chat"
    served_model_names: Annotated[list[str], option("the model ids clients use", flag="--served-model-name",
                                                    default_text="--model as given")] = []
    model_path: Annotated[str, option("the checkpoint's local directory", derived=True)] = ""
    runtime_dir: Annotated[str, option("this server's private directory of IPC sockets", derived=True)] = ""
    output_mode: Annotated[Literal["text", "tokens"], option(
        "how the model's serving extension reads its output: detokenized text, or token ids (gpt-oss through "
        "harmony)", derived=True)] = "text"
    host: Annotated[str, option("address to listen on")] = "127.0.0.1"
    port: Annotated[int, option("port to listen on", ge=0, le=65535)] = 8000
    ingress_workers: Annotated[int, option("HTTP worker processes (0: from the core count)", ge=0,
                                           default_text=AUTO_WORKERS)] = 0
    render_workers: Annotated[int, option("processes that render and tokenize prompts (0: from the core count)",
                                          ge=0, default_text=AUTO_WORKERS)] = 0
    postproc_workers: Annotated[int, option("processes that detokenize and frame outputs (0: from the core "
                                            "count)", ge=0, default_text=AUTO_WORKERS)] = 0
    max_model_len: Annotated[int, option("context length", ge=0, default_text="the checkpoint's")] = 0
    max_num_seqs: Annotated[int, option("sequences in the running batch", ge=1)] = 256
    max_num_batched_tokens: Annotated[int, option(
        "tokens per step (decodes first, then prefill chunks; a prompt's last chunk of up to an eighth of this "
        "joins the chunk before it)", ge=1)] = 2048
    prediction_draft_tokens: Annotated[int, option(
        "the most tokens of a request's predicted output (chat's `prediction`) a decoding choice verifies in a step, "
        "beside its next token (0: predictions are not drafted)", ge=0, le=64)] = 8
    block_size: Annotated[int, option("tokens per KV block", ge=1)] = 16
    enable_prefix_caching: Annotated[bool, option("do not reuse the KV blocks of earlier prompts",
                                                  flag="--no-prefix-caching")] = True
    num_kv_blocks: Annotated[int, option("KV cache size in blocks (overrides --kv-cache-memory)", ge=0,
                                         default_text="from --kv-cache-memory")] = 0
    kv_cache_memory: Annotated[int, option("KV cache size", unit="bytes", ge=0,
                                           default_text="1 GiB on CPU, 85% of free memory on CUDA")] = 0
    runner: Annotated[Literal["model", "replay"], option(
        "replay: emit recorded (or random) token ids instead of running the model")] = "model"
    replay_file: Annotated[str | None, option("JSONL of recorded token id sequences for --runner replay")] = None
    replay_step_ms: Annotated[float, option("simulated cost of a replay step", unit="ms", ge=0)] = 0.0
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], option(
        "compute dtype", default_text="auto: float32 on CPU, the checkpoint's bf16/fp16 on CUDA")] = "auto"
    kv_cache_dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3",
                                      "fp8_e5m2"], option(
        "the KV cache's dtype: a 16-bit cache under float32 activations halves what a step's attention reads and "
        "holds twice the tokens in a --kv-cache-memory (float16 is llama.cpp's default cache; bfloat16 keeps "
        "float32's range); 8-bit ones halve it again: int8 with a scale for each token's head (as llama.cpp's "
        "q8_0 cache), or vLLM's fp8 (= fp8_e4m3) and fp8_e5m2 (no scale: values saturate at 448 / 57,344)",
        default_text="auto: the compute dtype, float16 for quantized linears under float32")] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], option("where the engine runs (auto: CUDA if present)")] = "auto"
    quantization: Annotated[Literal["none", "int8", "q4"], option(
        "quantize a float checkpoint's linears at load (CPU): int8 as GGUF's Q8_0, q4 as its Q4_0 (a GGUF "
        "file's own quantized linears are kept as they are)")] = "none"
    generation_config: Annotated[str, option(
        "sampling defaults: auto takes the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty; a request's own values win), none the API's own (temperature 1, ...), or a "
        "directory holding a generation_config.json")] = "auto"
    chat_template: Annotated[str | None, option(
        "the chat template: a file, or the name of one in the checkpoint's tokenizer_config.json list",
        default_text="the checkpoint's")] = None
    tool_parser: Annotated[str | None, option(
        "tool-call parser for chat output: hermes, llama3_json, mistral, qwen3_coder, deepseek_v3, pythonic, "
        "granite, auto (chosen from the chat template, said in the log), gpt_oss (gpt-oss)")] = None
    reasoning_parser: Annotated[str | None, option(
        "reasoning parser for chat output: think, qwen3, deepseek_r1 (all before </think> is reasoning), auto "
        "(chosen from the chat template), gpt_oss (gpt-oss)")] = None
    strict_tools: Annotated[bool, option(
        "refuse (400) a Responses request with a tool this server does not offer the model (web_search and the "
        "other hosted tools); by default such a tool is left out of the prompt, and the response's `warnings` "
        "and a log line say so")] = False
    harmony: Annotated[bool, option("serve a gpt-oss checkpoint through its HF chat template, as text",
                                    flag="--no-harmony")] = True
    trust_request_chat_template: Annotated[bool, option(
        "allow a chat_template in requests (rendered in jinja2's sandbox, with a time limit)")] = False
    shm_threshold: Annotated[int, option("payloads of at least this size go through shared memory "
                                         "(bench/RESULTS.md#ipc-transport)", unit="bytes", ge=0)] = 1 << 20
    shutdown_timeout: Annotated[float, option("how long SIGTERM waits for in-flight requests", unit="s",
                                              ge=0)] = 30.0
    api_keys: Annotated[list[str], option("require 'Authorization: Bearer KEY' on /v1 routes (repeatable; also "
                                          "SLUICE_API_KEY, comma-separated)", flag="--api-key",
                                          default_text="none")] = []
    protect_metrics: Annotated[bool, option("require the API key on /metrics and the health routes too")] = False
    middleware: Annotated[list[str], option(
        "wrap the HTTP app in an ASGI middleware: module:factory or path/to/file.py:factory, the factory called "
        "with the app and returning the app around it (repeatable: the first given is the outermost; "
        "deploy/middleware_example.py)", default_text="none")] = []
    request_hook: Annotated[str | None, option(
        "a hook (module:name or path/to/file.py:name; a class is made once per render worker) that sees each "
        "rendered request before the engine, and may change its sampling parameters or refuse it with a 400 "
        "(docs/operations.md#hooks; deploy/hooks_example.py)")] = None
    post_processor_hook: Annotated[str | None, option(
        "a hook (module:name or path/to/file.py:name; a class is made once per postproc worker) that sees each "
        "choice's new text before the reasoning and tool-call parsers, and emits it (changed or not), suppresses "
        "it or ends the choice; not with gpt-oss through harmony (docs/operations.md#hooks)")] = None
    max_request_bytes: Annotated[int, option("larger request bodies get 413", unit="bytes", ge=1)] = 32 << 20
    request_timeout: Annotated[float, option("per-request deadline (504, or an error event in a stream; 0: none)",
                                             unit="s", ge=0)] = 0.0
    render_timeout: Annotated[float, option(
        "time to render one request (its prompt and grammar; a grammar compile is bound by its own timeout): past "
        "it, 408, and the render worker goes on to its next job. A render worker on one job longer than this, "
        "--grammar-compile-timeout and --stall-timeout together turns /health and /ready to 503", unit="s",
        gt=0)] = 10.0
    max_pending: Annotated[int, option("requests in flight before new ones get 503 with Retry-After", ge=1)] = 4096
    stall_timeout: Annotated[float, option("without engine progress this long (or a postproc worker on one job), "
                                           "/health and /ready answer 503", unit="s", gt=0)] = 2.0
    perf_metrics: Annotated[bool, option("add each request's stage timings to its response (the last chunk of a "
                                         "stream)")] = False
    stream_interval: Annotated[int, option("stream an event every N tokens per request (the first at once)",
                                           ge=1)] = 1
    coalesce_frames: Annotated[bool, option(
        "one event per token (per --stream-interval tokens) even when the postproc falls behind the engine "
        "(by default a request's tokens from steps that queued up go in one event)",
        flag="--no-coalesce-frames")] = True
    max_steps_ahead: Annotated[int, option(
        "engine steps a postproc worker may have waiting (sent, not yet taken); past it the engine waits for it "
        "(0: no limit), so a postproc that falls behind neither piles steps up nor coalesces more than that "
        "many tokens an event", ge=0)] = 2
    cpu_affinity: Annotated[str, option(
        "CPUs the engine and the postproc workers share (they trade a message every step): auto (where the stages "
        "outnumber the cores and the engine does not compute on the CPU: the last core; else none), off, or a "
        "list such as 3 or 2-3,6", pattern=r"^(auto|off|\d+(-\d+)?(,\d+(-\d+)?)*)$")] = "auto"
    cpu_threads: Annotated[str, option(
        "threads the engine's CPU kernels run on: auto (every core it may use, but one for the batch sizes whose "
        "steps measure faster on one: where others use the cores too, threads in lock-step stall), or a number",
        pattern=r"^(auto|[1-9]\d*)$")] = "auto"
    kv_timing_output: Annotated[str | None, option("append one JSON line of timings per finished request to this "
                                                   "file")] = None
    otlp_traces_endpoint: Annotated[str | None, option(
        "send each finished request's spans (request; render, queue, prefill, decode, postproc), under the caller's "
        "traceparent, to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (needs OpenTelemetry's SDK: pip "
        "install 'sluice[tracing]')")] = None
    log_format: Annotated[Literal["text", "json"], option("log line format")] = "text"
    max_connections: Annotated[int, option(
        "open connections across the ingress workers; past it a new connection waits, unanswered, in the "
        "kernel's accept queue until one closes (granian cannot answer 503 before it accepts)", ge=0,
        default_text=f"--max-pending + {CONNECTION_HEADROOM}")] = 0
    header_timeout: Annotated[float, option(
        "time to send a request's headers, and how long an idle keep-alive connection stays open", unit="s",
        ge=0.001, le=HEADER_TIMEOUT_MAX_S)] = 10.0
    body_timeout: Annotated[float, option("time to send a whole request body; past it, 408", unit="s", gt=0)] = 30.0
    max_stream_buffer: Annotated[int, option(
        "a stream's events waiting for a client that reads slower than they come; past it the request is "
        "aborted and the stream cut", unit="bytes", ge=1)] = 4 << 20
    grammar_backend: Annotated[Literal["llguidance", "xgrammar"], option(
        "the grammar engine for structured output and tool calls (bench/RESULTS.md#grammar-engines compares "
        "them; forced and strict tool calls need llguidance)")] = "llguidance"
    grammar_compile_timeout: Annotated[float, option(
        "time to compile one response_format schema; past it, 408", unit="s", gt=0)] = 10.0
    grammar_memory: Annotated[int, option(
        "memory a schema's compile may take; past it, 400 (the compile runs in a child process of the render "
        "worker)", unit="bytes", ge=1 << 20)] = 4 << 30
    grammar_max_bytes: Annotated[int, option(
        "largest compiled grammar a schema may give (the engine loads it); past it, 400", unit="bytes",
        ge=1)] = 64 << 20
    state_dir: Annotated[str, option(
        "where what users submit is kept (batches, stored responses: an SQLite database)",
        default_text="$SLUICE_STATE_DIR, else ~/.local/state/sluice")] = ""
    sealing_key_file: Annotated[str | None, option(
        "a file holding the key that seals reasoning (32 bytes, or their base64): servers behind one router that "
        "share it open each other's sealed reasoning (also SLUICE_SEALING_KEY: the key itself, in base64)",
        default_text="a key made under --state-dir")] = None
    background_concurrency: Annotated[int, option(
        "requests the background owner (batches, background responses) runs at once, behind interactive ones",
        ge=1)] = 32
    role: Annotated[Literal["both", "context", "generation"], option(
        "disaggregated serving: context (computes prompts' KV and hands it over), generation (takes it over and "
        "decodes), both (neither hand-off); every role serves ordinary requests too")] = "both"
    disagg_secret: Annotated[str | None, option(
        "the orchestrator's shared secret: disaggregated_params and kv_hints are taken only with it in the "
        "x-sluice-disagg-secret header, or with TensorRT-LLM's orchestrator's x-trtllm-disagg-auth signature made "
        "with it (required with a context or generation --role; also SLUICE_DISAGG_SECRET, which keeps it out of "
        "the process list)")] = None
    disagg_unsigned_context: Annotated[bool, option(
        "a context worker takes context_only requests without the secret, as TensorRT-LLM's orchestrator sends "
        "them (unsigned); their answers' opaque state is sealed, so only a caller with the secret can use it. "
        "Anyone who reaches the worker can then hold KV blocks for --kv-lease-timeout: let only the "
        "orchestrator reach it")] = False
    kv_transfer: Annotated[Literal["shm", "mooncake"], option(
        "how a generation worker reads a context worker's KV blocks: shm (one host), mooncake (Mooncake's "
        "transfer engine over TCP: across hosts); the same on every worker")] = "shm"
    kv_lease_timeout: Annotated[float, option(
        "how long a context worker keeps a prompt's KV blocks for a generation worker to read", unit="s",
        gt=0)] = 30.0
    kv_load_failure: Annotated[Literal["recompute", "fail"], option(
        "when a generation worker cannot read the KV (a lease expired, a context worker gone): compute the "
        "prompt itself, or fail the request")] = "recompute"
    kv_transfer_port: Annotated[int, option(
        "the context engine's KV control port (generation workers release leases there)", ge=0, le=65535,
        default_text="a free port")] = 0
    kv_events: Annotated[bool, option("do not publish the prefix cache's block events for a KV-aware router",
                                      flag="--no-kv-events")] = True
    kv_events_port: Annotated[int, option("port of the prefix cache's block events (ZeroMQ PUB)", ge=0,
                                          le=65535, default_text="a free port")] = 0
    grpc_port: Annotated[Annotated[int, Meta(ge=0, le=65535)] | None, option(
        "also serve the SGLang model gateway's gRPC worker protocol on this port (sglang-router --worker-urls "
        "grpc://HOST:PORT): token ids in and out, the router renders and detokenizes (docs/grpc.md); 0: a free "
        "port, said in the log", flag="--grpc", default_text="off")] = None
    advertise_host: Annotated[str | None, option(
        "the address other hosts reach this server's KV ports at", default_text="--host")] = None

    def __post_init__(self) -> None:
        for name in ("ingress_workers", "render_workers", "postproc_workers"):
            if not getattr(self, name):  # 0: from the core count
                msgspec.structs.force_setattr(self, name, auto_workers())

    @property
    def connection_limit(self) -> int:
        return self.max_connections or self.max_pending + CONNECTION_HEADROOM

    @property
    def addresses(self) -> Addresses:
        return Addresses(self.runtime_dir)

    def bulk(self) -> dict:
        """Channel options for sockets that carry bulk payloads through shared memory."""
        return {"shm_dir": self.addresses.shm_dir, "shm_threshold": self.shm_threshold}

    def hf_config(self) -> dict:
        return json.loads((Path(self.model_path) / "config.json").read_text())

    def dump(self, path: Path) -> None:
        """Written whole or not at all (a stage that starts meanwhile reads the old or the new file)."""
        part = path.with_name(path.name + ".part")
        part.write_bytes(msgspec.json.encode(self))
        os.replace(part, path)

    @classmethod
    def load(cls, path: str) -> "ServerConfig":
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1e9' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))
