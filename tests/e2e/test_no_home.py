"""The systemd finding: the service user has no home. With the unit's CacheDirectory= and StateDirectory=
Sluice keeps everything there; without them, the engine used to die building its first CPU kernel (it
must serve on torch's kernels instead)."""
from __future__ import annotations

import shutil
import stat
import subprocess

import httpx
import pytest

from bench.server import Server
from sluice.engine.cpu import build as kernel_build
from tests.test_deploy import UNIT, _environment, _settings

UNWRITABLE = "/proc/sluice-no-home"  # not even root can make a directory under /proc
# Root without any capability: the file modes apply to it as to any user (no CAP_DAC_OVERRIDE).
NO_CAPABILITIES = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs")
KERNEL_CPU = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= kernel_build.cpu_flags()


def _generates(server: Server, model: str) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": model, "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _can_drop_capabilities() -> bool:
    if not shutil.which("setpriv"):
        return False
    return subprocess.run([*NO_CAPABILITIES, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_drop_capabilities(), reason="needs setpriv, able to drop every capability")
def test_the_units_directories_are_all_sluice_needs(tmp_path):
    """As the unit runs it: a home it cannot write, no capability, and the unit's Environment= with its
    directories (Cache-, State-, RuntimeDirectory=) standing in for what systemd creates, owned by the
    service user. Sluice writes the built-in checkpoint and its kernels there, and serves."""
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    dirs = {"/var/cache/sluice": tmp_path / "cache", "/var/lib/sluice": tmp_path / "state",
            "/run/sluice": tmp_path / "run"}
    for d in dirs.values():
        d.mkdir()
    env = {"HOME": str(home), "XDG_CACHE_HOME": "", "XDG_STATE_HOME": ""}
    for key, value in _environment(_settings(UNIT.read_text())).items():
        for unit_dir, here in dirs.items():
            value = value.replace(unit_dir, str(here))
        env[key] = value
    server = Server("--dtype", "bfloat16", env=env, launcher=NO_CAPABILITIES)
    try:
        _generates(server, "builtin:tiny-chat")
    finally:
        assert server.stop() == 0, server.output()
    assert list(home.iterdir()) == [] and stat.S_IMODE(home.stat().st_mode) == 0o555
    assert (tmp_path / "cache" / "builtin").is_dir()
    if KERNEL_CPU:
        assert list((tmp_path / "cache" / "kernels").glob("*.so")), server.output()
    assert "Traceback" not in server.output()


def test_a_server_with_no_writable_home_or_cache_serves(tiny_chat_dir):
    """The old unit: nowhere to write at all. The kernels fall back to torch's, with a log line."""
    env = {"HOME": UNWRITABLE, "XDG_CACHE_HOME": UNWRITABLE, "SLUICE_CACHE_DIR": UNWRITABLE + "/cache",
           "XDG_STATE_HOME": UNWRITABLE, "SLUICE_STATE_DIR": UNWRITABLE + "/state", "CC": "gcc"}
    server = Server("--model", str(tiny_chat_dir), "--dtype", "bfloat16", env=env)
    try:
        _generates(server, str(tiny_chat_dir))
    finally:
        assert server.stop() == 0
    log = server.output()
    if KERNEL_CPU:
        assert "CPU kernel" in log and "not used" in log  # it tried, fell back, and said so
    assert "Traceback" not in log
