"""The systemd finding: the service user has no home and, without the unit's CacheDirectory=, no cache
directory either. The engine used to die building its first CPU kernel; it must serve on torch's."""
from __future__ import annotations

import httpx

from bench.server import Server
from engine import cpu_kernels

UNWRITABLE = "/proc/sluice-no-home"  # not even root can make a directory under /proc


def test_a_server_with_no_writable_home_or_cache_serves(tiny_chat_dir):
    env = {"HOME": UNWRITABLE, "XDG_CACHE_HOME": UNWRITABLE, "SLUICE_CACHE_DIR": UNWRITABLE + "/cache",
           "XDG_STATE_HOME": UNWRITABLE, "SLUICE_STATE_DIR": UNWRITABLE + "/state", "CC": "gcc"}
    server = Server("--model", str(tiny_chat_dir), "--dtype", "bfloat16", env=env)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": str(tiny_chat_dir), "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0
    log = server.output()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_kernels.cpu_flags():
        assert "CPU kernel" in log and "not used" in log  # it tried, fell back, and said so
    assert "Traceback" not in log
