"""What granian must be told so that connections, not only requests, are bounded.

granian (2.8) holds one permit per open connection, `--backpressure` of them per worker; with every
permit taken it stops calling accept(), so a new connection waits in the kernel's accept queue
(`--backlog`), unanswered, until a held one closes; past that queue the kernel drops the SYN and
the client retries. granian cannot answer 503 for a connection it has not accepted, so the limit
is set above --max-pending (whose 503s then apply first), and every way to hold a connection
without a request in flight is timed out: headers and idle keep-alives by granian, bodies by the
app (sluice.ingress.http.read_body).
"""
from __future__ import annotations

import logging
import resource

from sluice.base.config import ServerConfig

log = logging.getLogger("sluice.ingress")
_SPARE_FDS = 256  # this worker's own files and sockets: ZeroMQ, shared memory, logs, metrics files


def connections_per_worker(cfg: ServerConfig) -> int:
    return -(-cfg.connection_limit // cfg.ingress_workers)


def granian_args(cfg: ServerConfig) -> list[str]:
    """granian's command-line options for the connection limits in `cfg`."""
    return [
        # HTTP/1 only: in auto mode granian first sniffs the protocol with no timeout at all, so a
        # connection that sends nothing would be held forever (the header timeout starts after it).
        "--http", "1",
        "--backpressure", str(connections_per_worker(cfg)),
        # hyper starts this timer whenever it waits for a request's headers: idle keep-alives included
        "--http1-header-read-timeout", str(max(1, round(cfg.header_timeout * 1000))),
    ]


def raise_open_files_limit(cfg: ServerConfig) -> None:
    """Lets this ingress worker hold its share of --max-connections: with the soft limit too low (1024 under
    systemd), accept() fails with EMFILE and granian retries it in a busy loop."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections_per_worker(cfg) + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            log.warning("open files limited to %d (hard limit): fewer than the %d this worker's share of "
                        "--max-connections needs; raise LimitNOFILE", target, need)
