"""Auth, limits, health that tells the truth, and systemd notifications, on a server of their own."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from bench.server import Server
from tests.e2e.conftest import MODEL

KEY = {"authorization": "Bearer k2"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("notify") / "sd.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    yield path, sock
    sock.close()


@pytest.fixture(scope="module")
def prod(notify):
    s = Server("--api-key", "k1", "--api-key", "k2", "--max-request-bytes", "4000", "--request-timeout", "2",
               "--max-pending", "3", env={"NOTIFY_SOCKET": notify[0], "WATCHDOG_USEC": "400000"}, headers=KEY)
    yield s
    s.stop(signal.SIGKILL)


def _messages(sock, seconds: float, enough=lambda out: False) -> list[str]:
    """What the socket got, read until `enough(out)` or for `seconds`."""
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and not enough(out):
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return out


def test_stages_let_openmp_threads_sleep_unless_told_otherwise(prod):
    """OMP_WAIT_POLICY=PASSIVE (the user's own value wins): spinning OpenMP threads rob the server's other
    processes of the cores they share."""
    with open(f"/proc/{prod.stage_pid('engine')}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert env[b"OMP_WAIT_POLICY"].decode() == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def test_api_keys(prod):
    url = prod.url + "/v1/chat/completions"
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}):
        r = httpx.post(url, json=CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for key in ("k1", "k2"):
        auth = {"authorization": f"Bearer {key}"}
        assert httpx.post(url, json=dict(CHAT, max_tokens=1), headers=auth).status_code == 200
    assert httpx.get(prod.url + "/v1/models").status_code == 401
    for path in ("/health", "/ready", "/metrics", "/version"):  # open without --protect-metrics
        assert httpx.get(prod.url + path).status_code == 200


def test_body_limit_and_deadline(prod):
    r = httpx.post(prod.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}, headers=KEY)
    assert r.status_code == 413
    long = dict(CHAT, max_tokens=4000, ignore_eos=True)
    r = httpx.post(prod.url + "/v1/chat/completions", json=long, headers=KEY, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"  # (only --request-timeout answers so)
    with httpx.stream("POST", prod.url + "/v1/chat/completions", json=dict(long, stream=True), headers=KEY,
                      timeout=30) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert '"timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while prod.metrics()["sluice:num_requests_running"] > 0:  # the engine dropped them
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_admission_limit_answers_503_with_retry_after(prod):
    started = threading.Barrier(4)

    def hold():
        with httpx.stream("POST", prod.url + "/v1/chat/completions", headers=KEY, timeout=30,
                          json=dict(CHAT, max_tokens=2000, ignore_eos=True, stream=True)) as s:
            started.wait()
            for _ in s.iter_lines():
                pass

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait(20)
    r = httpx.post(prod.url + "/v1/chat/completions", json=dict(CHAT, max_tokens=1), headers=KEY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    for t in threads:
        t.join(30)
    assert httpx.post(prod.url + "/v1/chat/completions", json=dict(CHAT, max_tokens=1), headers=KEY).status_code == 200


def test_health_generate_and_a_stuck_engine(prod):
    r = httpx.get(prod.url + "/health_generate")
    assert r.status_code == 200 and r.json()["latency_ms"] > 0
    engine = prod.stage_pid("engine")
    os.kill(engine, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while httpx.get(prod.url + "/health").status_code == 200:  # (--stall-timeout 2 s; 10: loaded cores)
            assert time.monotonic() - t0 < 10, "a stuck engine still looks healthy"
            time.sleep(0.1)
        assert httpx.get(prod.url + "/ready").status_code == 503
    finally:
        os.kill(engine, signal.SIGCONT)
    t0 = time.monotonic()
    while httpx.get(prod.url + "/ready").status_code != 200:
        assert time.monotonic() - t0 < 10  # (one heartbeat after SIGCONT; 10 s: loaded cores)
        time.sleep(0.1)


def test_systemd_notifications(prod, notify):
    _, sock = notify
    seen = _messages(sock, 5, lambda out: out.count("WATCHDOG=1") >= 2)  # (queued on the socket since startup)
    assert seen[0] == "READY=1"
    assert seen.count("WATCHDOG=1") >= 2  # every WatchdogSec/2 while the engine is fine
    prod.proc.send_signal(signal.SIGTERM)
    assert prod.proc.wait(30) == 0
    assert "STOPPING=1" in _messages(sock, 2, lambda out: "STOPPING=1" in out) + seen
