"""Every environment variable Sluice reads, in one place."""
from __future__ import annotations

import os
import shlex
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in checkpoints and unpacked vocabularies live."""
    base = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sluice"
    )
    return Path(base)


def state_dir() -> Path:
    """Where what must outlive a restart lives (the batch and stored-response database)."""
    base = os.environ.get("SLUICE_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "sluice"
    )
    return Path(base)


def runtime_base() -> str:
    """Parent of the per-server runtime directory holding the IPC sockets."""
    return os.environ.get("XDG_RUNTIME_DIR") or "/tmp"


def config_path() -> str | None:
    """Set by the supervisor for the ingress workers that granian starts."""
    return os.environ.get("SLUICE_CONFIG")


def disagg_secret() -> str | None:
    """The disaggregation orchestrator's shared secret (SLUICE_DISAGG_SECRET): kept out of `ps`, unlike a flag."""
    return os.environ.get("SLUICE_DISAGG_SECRET") or None


def sealing_key() -> str | None:
    """The key that seals reasoning (SLUICE_SEALING_KEY: base64 of 32 bytes), shared by servers behind a router."""
    return os.environ.get("SLUICE_SEALING_KEY") or None


def sealing_key_file() -> str | None:
    """A file holding that key (SLUICE_SEALING_KEY_FILE; `sluice serve --sealing-key-file` sets it for its
    processes)."""
    return os.environ.get("SLUICE_SEALING_KEY_FILE") or None


def api_keys() -> list[str]:
    raw = os.environ.get("SLUICE_API_KEY", "")
    return [k for k in raw.split(",") if k]


def worker_api_key() -> str | None:
    """SLUICE_WORKER_API_KEY: the key `sluice router` sends its workers (kept out of `ps`, unlike a flag)."""
    return os.environ.get("SLUICE_WORKER_API_KEY") or None


def tiktoken_encodings_base() -> str | None:
    """Where openai-harmony looks for o200k_base.tiktoken (set by the user, or by sluice.base.harmony_vocab)."""
    return os.environ.get("TIKTOKEN_ENCODINGS_BASE")


def set_tiktoken_encodings_base(path: str) -> None:
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = path


def set_prometheus_dir(path: str) -> None:
    """prometheus_client's multiprocess directory: set before any stage imports prometheus_client."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def prometheus_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def notify_socket() -> str | None:
    return os.environ.get("NOTIFY_SOCKET")


def watchdog_seconds() -> float | None:
    """systemd's WatchdogSec, when the service has one (WATCHDOG_USEC)."""
    usec = os.environ.get("WATCHDOG_USEC")
    return int(usec) / 1e6 if usec else None


def cpu_kernels_enabled() -> bool:
    """SLUICE_CPU_KERNELS=0 keeps the engine on torch's own CPU kernels (no C compiler is run)."""
    return os.environ.get("SLUICE_CPU_KERNELS", "1") != "0"


def cpu_hidden_isa() -> frozenset[str]:
    """SLUICE_CPU_HIDE: instruction sets (as /proc/cpuinfo names them, comma-separated, e.g.
    `avx512_bf16,avx512_vnni`) the CPU kernels act as if this CPU lacked: runs and tests the paths other
    CPUs take."""
    return frozenset(f.strip() for f in os.environ.get("SLUICE_CPU_HIDE", "").split(",") if f.strip())


def quant_activations() -> str | None:
    """SLUICE_QUANT_ACTIVATIONS: how the CPU's quantized linears take their rows, `int8` (quantized per block
    of 32, llama.cpp's way), `float` (float32, the weight dequantized in the kernel) or `auto` (whichever
    measures faster here, at start); unset: int8, the weights repacked at load (why: engine/cpu/quant.py)."""
    value = os.environ.get("SLUICE_QUANT_ACTIVATIONS", "").strip().lower()
    if value not in ("", "int8", "float", "auto"):
        raise ValueError(f"SLUICE_QUANT_ACTIVATIONS={value!r}: expected int8, float or auto")
    return value or None


def c_compiler() -> list[str] | None:
    """The C compiler command for Sluice's CPU kernels, split as a shell would: CC is a command line, as
    make reads it (`ccache gcc`). None where CC is unset or blank (the caller looks for cc or gcc);
    ValueError where it does not parse (an unclosed quote)."""
    return shlex.split(os.environ.get("CC", "")) or None


def default_omp_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE for the stages unless the user set it: OpenMP threads then sleep when a
    parallel region ends instead of spinning. The engine shares the machine's cores with the server's
    other processes (and, in benchmarks, the client's), which the spinning thread robbed: alternating
    runs at concurrency 16 / 64 gave more tokens/s (bench/JOURNAL.md, 2026-11-30 third session)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
