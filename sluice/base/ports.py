"""TCP ports: the HTTP port held from the first moment (so no port the server picks later can be it), and free
ports for the ones it picks."""
from __future__ import annotations

import socket


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def hold(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a port the kernel picks) that keeps every other socket off the port until
    it is closed, while granian's listeners (SO_REUSEPORT, the same user) still bind beside it. It never
    listens, so every connection goes to granian. OSError where anything holds the port already."""
    s = socket.socket(_family(host))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last run's TIME_WAIT connections
        s.bind((host, port))  # without SO_REUSEPORT: refused beside any socket on the port, a listener's too
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)  # others' SO_REUSEADDR binds refused from now
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # granian's listeners may join it now
    except OSError:
        s.close()
        raise
    return s


def free_port(host: str) -> int:
    """A port nothing holds now (it can be taken before the caller binds it: held ports are never handed out)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
