"""Sluice's C kernels for the CPU: compiled on first use with the machine's C compiler, cached under the
cache directory (keyed by the source and the flags) and loaded with ctypes.

A kernel is optional: without a compiler, on a CPU without the instructions it needs, with no writable
cache directory, when the build fails, or with SLUICE_CPU_KERNELS=0, `load` returns None and the caller
keeps its torch path. The kernels use OpenMP; torch is imported first, so they share the libgomp (and the
threads) torch runs on.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401 (loaded before any kernel: its libgomp is the one the kernels link to)

from sluice.base import envs

log = logging.getLogger("sluice.engine")

_SOURCES = Path(__file__).parent.parent / "csrc"
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
# Instruction sets (as /proc/cpuinfo names them) -> the compiler flags that enable them.
_ISA = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_bf16": "-mavx512bf16",
        "avx512_vnni": "-mavx512vnni", "avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c", "amx_tile": "-mamx-tile",
        "amx_bf16": "-mamx-bf16"}
_AVX512 = ("avx512f", "avx512bw")
_AVX512_VL = (*_AVX512, "avx512vl")
_AVX512_VL_VNNI = (*_AVX512_VL, "avx512_vnni")
_AVX512_BF16 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_AVX512_VNNI = (*_AVX512_BF16, "avx512_vnni")
_AMX = (*_AVX512_BF16, "amx_tile", "amx_bf16")
_AVX2 = ("avx2", "fma", "f16c")  # (F16C: every AVX2 CPU has it; an fp16 KV cache)
_BUILD_TIMEOUT_S = 120


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction sets as /proc/cpuinfo names them, less those SLUICE_CPU_HIDE names (to run,
    and test, the paths of a CPU without them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) - envs.cpu_hidden_isa()
    except OSError:
        pass
    return frozenset()


@functools.cache
def load(name: str, isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel library csrc/<name>.c (with the headers beside it) built for the instruction sets `isa`,
    or None, with one warning saying why, where it cannot be built or loaded: the caller keeps its torch
    path. Never raises (a kernel is worth a build, not a crashed engine)."""
    if not envs.cpu_kernels_enabled():
        return None
    missing = [f for f in isa if f not in cpu_flags()]
    if missing:
        log.info("CPU kernel %s not used: this CPU lacks %s", name, ", ".join(missing))
        return None
    if not _torch_runs_libgomp():
        log.info("CPU kernel %s not used: torch's OpenMP runtime is not libgomp", name)
        return None
    try:
        compiler = _compiler()
        source = _SOURCES / f"{name}.c"
        flags = [*_FLAGS, *(_ISA[f] for f in isa)]
        path = envs.cache_dir() / "kernels" / f"{name}-{_key(source, flags)}.so"
        if not path.exists():
            _build(compiler, flags, source, path)
        return ctypes.CDLL(str(path))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("CPU kernel %s not used (torch's path instead): %s", name, _why(e))
        return None


def _compiler() -> list[str]:
    """CC as a command line (`ccache gcc`), else cc or gcc; FileNotFoundError where there is none."""
    command = envs.c_compiler()
    if command is None:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            raise FileNotFoundError("no C compiler (install cc or gcc, or set CC)")
        return [found]
    if shutil.which(command[0]) is None:
        raise FileNotFoundError(f"the C compiler {command[0]!r} (CC) is not found")
    return command


def _key(source: Path, flags: list[str]) -> str:
    """What a build depends on: the flags and every source (a source may include another's)."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for part in [source, *sorted(_SOURCES.iterdir())]:
        digest.update(part.read_bytes())
    return digest.hexdigest()[:16]


def _build(compiler: list[str], flags: list[str], source: Path, path: Path) -> None:
    """Compiles source into path. Builds of other sources or flags are left alone: the cache may be shared
    by installs of other versions, each loading its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-I", str(_SOURCES), "-o", tmp, str(source)], check=True,
                       capture_output=True, timeout=_BUILD_TIMEOUT_S)
        os.replace(tmp, path)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _why(e: Exception) -> str:
    """A failed build or load in one line."""
    if isinstance(e, subprocess.CalledProcessError):
        lines = [line for line in (e.stderr or b"").decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line] or lines[-1:]
        return f"the build failed (exit {e.returncode})" + (f": {errors[0].strip()}" if errors else "")
    if isinstance(e, subprocess.TimeoutExpired):
        return f"the build took longer than {e.timeout:.0f}s"
    if isinstance(e, ValueError):
        return f"CC does not parse as a command line ({e})"
    return str(e)


def _torch_runs_libgomp() -> bool:
    """Whether the libgomp the kernels link to is the OpenMP runtime torch has loaded (not a second pool
    of threads beside torch's)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def clear() -> None:
    """Forgets what was loaded (tests that change the environment)."""
    load.cache_clear()
    cpu_flags.cache_clear()
    for forget in _forgetters:
        forget()


_forgetters: list = []  # (the kernels' own caches: engine/cpu/kernels.py registers them)
