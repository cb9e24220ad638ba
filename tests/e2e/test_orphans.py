"""Every process a server starts dies with it, however the supervisor dies: nothing is left holding the
port (granian's workers listen with SO_REUSEPORT, so an orphan would share a restarted server's port). A
supervisor exiting after the engine died: test_lifecycle's engine death."""
from __future__ import annotations

import errno
import os
import signal
import socket
import time

from bench.faults import ingress_workers
from bench.procs import alive, descendants, title
from bench.server import Server

_GONE_WITHIN_S = 5.0


def _start(*flags: str) -> tuple[Server, set[int]]:
    """A server and its processes, once both ingress workers run (granian starts them one by one)."""
    server = Server("--ingress-workers", "2", "--render-workers", "2", "--postproc-workers", "2", *flags)
    deadline = time.monotonic() + 60
    while len(ingress_workers(server)) < 2:
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"the second ingress worker never started:\n{server.output()}")
        time.sleep(0.1)
    return server, descendants(server.proc.pid)


def _port_is_free(port: int) -> bool:
    """A bind that a listening socket anywhere on the port refuses (SO_REUSEADDR only passes TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _assert_all_gone(server: Server, pids: set[int]) -> None:
    deadline = time.monotonic() + _GONE_WITHIN_S
    while True:
        left = {pid for pid in pids if alive(pid)}
        if not left and _port_is_free(server.port):
            return
        assert time.monotonic() < deadline, (f"still alive {_GONE_WITHIN_S}s after the supervisor: "
                                             f"{ {pid: title(pid) for pid in left} }, port free: "
                                             f"{_port_is_free(server.port)}\n{server.output()}")
        time.sleep(0.1)


def _kill_all(server: Server, pids: set[int]) -> None:
    """What a failure left behind: not for the next test to trip on."""
    server.stop(signal.SIGKILL)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_supervisor_takes_every_process_of_its_server_with_it():
    server, pids = _start()
    try:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        _assert_all_gone(server, pids)
    finally:
        _kill_all(server, pids)

