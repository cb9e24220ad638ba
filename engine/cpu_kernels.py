"""Sluice's C kernels for the CPU: compiled on first use with the machine's C compiler, cached under the
cache directory (keyed by the source and the flags) and loaded with ctypes.

A kernel is optional: without a compiler, on a CPU without the instructions it needs, when the build
fails, or with SLUICE_CPU_KERNELS=0, `load` returns None and the caller keeps its torch path. The
kernels use OpenMP; torch is imported first, so they share the libgomp (and the threads) torch runs on.
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

import torch  # noqa: F401  (loaded before any kernel: its libgomp is the one the kernels link to)

from sluice import envs

log = logging.getLogger("sluice.engine")

_SOURCES = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
# Instruction sets (as /proc/cpuinfo names them) -> the compiler flags that enable them.
_ISA = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_bf16": "-mavx512bf16"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def load(name: str, isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel library csrc/<name>.c built for the instruction sets `isa`, or None (and why, logged)."""
    if not envs.cpu_kernels_enabled():
        return None
    missing = [f for f in isa if f not in cpu_flags()]
    if missing:
        log.info("CPU kernel %s not used: this CPU lacks %s", name, ", ".join(missing))
        return None
    if not _torch_runs_libgomp():
        log.info("CPU kernel %s not used: torch's OpenMP runtime is not libgomp", name)
        return None
    compiler = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("CPU kernel %s not used: no C compiler (set CC)", name)
        return None
    source = (_SOURCES / f"{name}.c").read_bytes()
    flags = [*_FLAGS, *(_ISA[f] for f in isa)]
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    path = envs.cache_dir() / "kernels" / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, "-o", tmp, "-x", "c", "-"], input=source, check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, path)  # atomic: processes building at once each install a whole file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("CPU kernel %s not used: the build failed: %s %s", name, e,
                        detail.decode(errors="replace")[-2000:])
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # e.g. a libgomp older than the compiler's
        log.warning("CPU kernel %s not used: %s", name, e)
        return None


def _torch_runs_libgomp() -> bool:
    """Whether the libgomp the kernels link to is the OpenMP runtime torch has loaded (not a second pool
    of threads beside torch's)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False
