"""Building and caching the CPU kernels (engine/cpu/build.py `load`): any failure to build or load one
is one warning and the torch path, never an exception; CC is a command line; a cache shared by several
installs keeps every install's builds. A toy kernel stands in for csrc/ here, so these run on any CPU."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sluice.engine.cpu import build as kernel_build

ROOT = Path(__file__).resolve().parents[2]
_TOY = "int sluice_toy(void) { return TOY; }\n"
needs_compiler = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
needs_libgomp = pytest.mark.skipif(not kernel_build._torch_runs_libgomp(), reason="torch does not run libgomp")
pytestmark = [needs_compiler, needs_libgomp]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """csrc/ holding one toy kernel, an empty cache, CC unset; build() is one uncached `load`."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "toy.c").write_text(_TOY.replace("TOY", "42"))
    monkeypatch.setattr(kernel_build, "_SOURCES", sources)
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("SLUICE_CPU_KERNELS", raising=False)
    return lambda: kernel_build.load.__wrapped__("toy", ())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sluice.engine" and r.levelno >= logging.WARNING]


def _built(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "kernels").glob("toy-*.so"))


def test_a_kernel_is_built_once_into_the_cache_and_loaded(toy, tmp_path, monkeypatch):
    assert toy().sluice_toy() == 42
    assert len(_built(tmp_path)) == 1
    monkeypatch.setenv("CC", "false")  # a cached build needs no compiler run
    assert toy().sluice_toy() == 42


def test_a_cache_directory_that_cannot_be_created_falls_back_with_one_warning(toy, tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and "Not a directory" in _warnings(caplog)[0], caplog.text


def test_a_cache_directory_that_cannot_be_written_falls_back_with_one_warning(toy, tmp_path, monkeypatch, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    kernels.chmod(0o555)
    if os.geteuid() == 0:  # (modes do not bind root: the refusal an unprivileged user gets, as the OS says it)
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(kernels))
        monkeypatch.setattr(kernel_build.tempfile, "mkstemp", refuse)
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and "Permission denied" in _warnings(caplog)[0], caplog.text
    kernels.chmod(0o755)


@pytest.mark.parametrize("cc, why", [("no-such-cc", "'no-such-cc' (CC) is not found"),
                                     ("false", "the build failed (exit 1)"),
                                     ("'gcc", "CC does not parse")])
def test_a_compiler_that_is_missing_or_fails_falls_back_with_one_warning(toy, monkeypatch, caplog, cc, why):
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and why in _warnings(caplog)[0], caplog.text


def test_no_compiler_on_the_path_falls_back_with_one_warning(toy, monkeypatch, caplog):
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and "no C compiler" in _warnings(caplog)[0], caplog.text


def test_a_compile_error_is_one_line_naming_the_error(toy, tmp_path, caplog):
    (tmp_path / "csrc" / "toy.c").write_text("int sluice_toy(void) { return undeclared; }\n")
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    (message,) = _warnings(caplog)
    assert "error:" in message and "undeclared" in message and "\n" not in message
    assert not list((tmp_path / "cache" / "kernels").iterdir())  # no temporary file left behind


def test_a_build_that_times_out_falls_back(toy, monkeypatch, caplog):
    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
    monkeypatch.setattr(kernel_build.subprocess, "run", slow)
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and "longer than 120s" in _warnings(caplog)[0], caplog.text


def test_a_build_that_does_not_load_falls_back(toy, tmp_path, caplog):
    source = tmp_path / "csrc" / "toy.c"
    path = tmp_path / "cache" / "kernels" / f"toy-{kernel_build._key(source, list(kernel_build._FLAGS))}.so"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")  # (a file this process has not loaded: dlopen would reuse that)
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        assert toy() is None
    assert len(_warnings(caplog)) == 1 and str(path) in _warnings(caplog)[0], caplog.text


@pytest.mark.parametrize("cc", ["env gcc", "ccache gcc"])
def test_cc_is_a_command_line_as_make_reads_it(toy, tmp_path, monkeypatch, cc):
    if not shutil.which(cc.split()[0]) or not shutil.which("gcc"):
        pytest.skip(f"{cc.split()[0]} or gcc is not installed")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
    assert toy().sluice_toy() == 42


def test_a_build_of_other_sources_leaves_the_earlier_build_in_place(toy, tmp_path):
    """Two installs (or versions) sharing a cache each keep their kernels."""
    assert toy().sluice_toy() == 42
    (first,) = _built(tmp_path)
    (tmp_path / "csrc" / "toy.c").write_text(_TOY.replace("TOY", "7"))
    assert toy().sluice_toy() == 7
    assert first.exists() and len(_built(tmp_path)) == 2
    (tmp_path / "csrc" / "toy.c").write_text(_TOY.replace("TOY", "42"))
    assert toy().sluice_toy() == 42


# ---- as the systemd unit runs it: an unprivileged user without a home ---------------------------------

_UNPRIVILEGED = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
_LOAD = ("import logging; logging.basicConfig(); from sluice.engine.cpu import build as kernel_build; "
         "print(kernel_build.load('rms_norm', kernel_build._AVX512_BF16) is not None)")


def _as_nobody(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SLUICE_CACHE_DIR", "XDG_CACHE_HOME", "CC")}
    return subprocess.run([*_UNPRIVILEGED, sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, "HOME": "/nonexistent", "PYTHONPATH": str(ROOT), **env}, timeout=300)


def _skip_unless_nobody_runs_sluice() -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as user nobody")
    probe = _as_nobody("import sluice.engine.cpu.build")
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot import Sluice with {sys.executable}: its install or this checkout is "
                    f"not readable by others (e.g. under /root, mode 700): {probe.stderr.strip().splitlines()[-1:]}")


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= kernel_build.cpu_flags(),
                    reason="this CPU lacks AVX512-BF16")
def test_an_unprivileged_user_without_a_home_gets_the_torch_path_then_the_kernel_in_its_cache_dir():
    _skip_unless_nobody_runs_sluice()
    homeless = _as_nobody(_LOAD)
    assert homeless.returncode == 0 and homeless.stdout.split() == ["False"], homeless.stderr
    assert homeless.stderr.count("not used") == 1, homeless.stderr
    cache = tempfile.mkdtemp(prefix="sluice-nobody-cache-")  # what systemd's CacheDirectory= gives the user
    try:
        shutil.chown(cache, "nobody", "nogroup")
        cached = _as_nobody(_LOAD, SLUICE_CACHE_DIR=cache)
        assert cached.returncode == 0 and cached.stdout.split() == ["True"], cached.stderr
        assert list(Path(cache, "kernels").glob("rms_norm-*.so"))
    finally:
        shutil.rmtree(cache)
