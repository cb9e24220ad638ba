"""Start and stop a real `sluice router` on a free loopback port (for tests and benchmarks)."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

from bench.server import ROOT, announced_port, wait_healthy


class RouterProc:
    def __init__(self, *args: str, startup_timeout: float = 60.0, headers: dict | None = None) -> None:
        """`sluice router` flags in args (--workers URL..., or --context/--generation); `.url` once it answers
        on the port it picked and holds (`headers`: what its health route wants, with --protect-metrics)."""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sluice-router-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sluice", "router", "--port", "0", "--health-interval", "0.25", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.port = announced_port(self.proc, self.log.name, startup_timeout)
            self.url = f"http://127.0.0.1:{self.port}"
            wait_healthy(self.proc, self.url, startup_timeout, headers)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.output()}") from None

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=5).text

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
