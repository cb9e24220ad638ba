"""The HTTP port is held from the server's first moment: nothing it (or anyone) binds later can take it, while
granian's listeners join it and get every connection."""
import socket
import subprocess
import sys
import time

import pytest
import zmq

from bench.server import ROOT
from sluice.base import ports


def _listener(port: int) -> socket.socket:
    """A listener as granian binds one on Linux (SO_REUSEADDR + SO_REUSEPORT)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_held_port_refuses_every_other_bind_but_the_listeners_that_join_it():
    with ports.hold("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError):
            ports.hold("127.0.0.1", port)  # another server told the same port
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        with socket.socket() as reuse, pytest.raises(OSError):  # SO_REUSEADDR, as ZeroMQ binds
            reuse.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reuse.bind(("127.0.0.1", port))
            reuse.listen()
        pub = zmq.Context.instance().socket(zmq.PUB)
        try:
            with pytest.raises(zmq.ZMQError):
                pub.bind(f"tcp://127.0.0.1:{port}")
        finally:
            pub.close(0)
        with _listener(port) as listener:
            for _ in range(20):  # the held socket never listens: every connection reaches the listener
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    conn, _ = listener.accept()
                    conn.close()
            with pytest.raises(OSError):
                ports.hold("127.0.0.1", port)  # nor can another server hold it while one listens


def test_a_port_is_held_again_right_after_its_server_closed_its_connections():
    """A restart at the same port (systemd) is not refused for the last run's TIME_WAIT connections."""
    with ports.hold("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with _listener(port) as listener:
            client = socket.create_connection(("127.0.0.1", port))
            conn, _ = listener.accept()
            conn.close()  # the server closes first: TIME_WAIT on its port
            time.sleep(0.05)
            client.close()
    with ports.hold("127.0.0.1", port):
        pass


def test_serve_on_a_port_taken_fails_at_once_naming_it(tiny_chat_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "sluice", "serve", "--port", str(port)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr
    assert "engine" not in run.stderr  # refused before any stage started
