"""Start and stop a real `sluice serve` on a free loopback port (for tests and benchmarks)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from sluice.base import ports

_SERVING_ON = re.compile(r"on http://\S+:(\d+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, headers: dict | None = None) -> None:
    """Until `url`/health answers 200; RuntimeError if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during startup (code {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=1, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not healthy after {timeout}s")
        time.sleep(0.2)


def free_port() -> int:
    """A free loopback port, for peers that cannot be told port 0 (another process may take it first)."""
    return ports.free_port("127.0.0.1")


def announced_port(proc: subprocess.Popen, log_path: str, timeout: float) -> int:
    """The port a Sluice server or router started with --port 0 serves on, read from its log's
    `on http://HOST:PORT`; RuntimeError if the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout
    while True:
        with open(log_path, errors="replace") as f:
            if m := _SERVING_ON.search(f.read()):
                return int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during startup (code {proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not say its port within {timeout}s")
        time.sleep(0.1)


class Server:
    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict | None = None,
                 headers: dict | None = None, launcher: tuple[str, ...] = (), port: int = 0) -> None:
        """Extra `sluice serve` flags in args; a 2048-block KV cache unless --kv-cache-memory is given;
        `launcher`: a command that runs it (e.g. setpriv with its options); `port`: 0 for one the server
        picks and holds (read back from its log: no other process can take it between the pick and the bind)."""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sluice-e2e-", suffix=".log", delete=False)
        if "--kv-cache-memory" not in args:
            args = ("--num-kv-blocks", "2048", *args)
        cmd = [*launcher, sys.executable, "-m", "sluice", "serve", "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            started = time.monotonic()
            self.port = announced_port(self.proc, self.log.name, startup_timeout)
            self.url = f"http://127.0.0.1:{self.port}"
            wait_healthy(self.proc, self.url, startup_timeout - (time.monotonic() - started), headers)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.output()}") from None

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stage_pid(self, role: str) -> int:
        output = self.output()
        m = re.search(rf"{role}\[0\] ready \(pid (\d+)\)", output)
        if m is None:
            raise RuntimeError(f"no {role}[0] ready line in the server's output:\n{output}")
        return int(m.group(1))

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5, headers=headers).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_:]+) ([0-9.e+-]+)$", text, re.M)}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
