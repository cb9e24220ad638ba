"""Starts the stages, waits for each to say ready, starts granian, then watches.

Engine (or any stage) death: every in-flight request gets an error, health
turns 503, and the supervisor exits non-zero so systemd restarts the service.
SIGTERM / SIGINT: drain (new requests get 503, in-flight ones finish within
--shutdown-timeout), then stop granian and the stages in order; exit 0.
"""
from __future__ import annotations

import fcntl
import glob
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

import msgspec
import zmq

from sluice.base import affinity, envs, procs
from sluice.base.config import ServerConfig
from sluice.base.logs import setup_logging
from sluice.ingress.server_options import granian_args
from sluice.ipc.messages import (ControlInput, Drain, DrainTimedOut, EngineDied, IngressGone, IngressStatus,
                                 PostprocInput, Ready, StageDied, SupervisorInput)
from sluice.ipc.shm import shm_base
from sluice.ipc.stats import EngineStats, StageClocks, StageRole, stall_limits
from sluice.ipc.transport import PubChannel, PullChannel, PushChannel

log = logging.getLogger("sluice")
_READY_TIMEOUT_S = 900.0
_ERROR_FLUSH_S = 1.0


def _kill_group(pgid: int) -> None:
    """SIGKILL to whatever is left of a child's process group (its own children, if it died before them)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stage_main(role: str, index: int, config_path: str) -> None:
    """Entry of every stage process."""
    procs.die_with_parent()
    procs.set_title(f"sluice: {role}" if role == "engine" else f"sluice: {role} {index}")
    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor only; it stops the stages in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = ServerConfig.load(config_path)
    setup_logging(f"{role}[{index}]", cfg.log_format)
    if role == "engine":
        from sluice.engine.worker import run_engine
        run_engine(cfg)
    elif role == "render":
        from sluice.render.worker import run_render
        run_render(cfg, index)
    elif role == "postproc":
        from sluice.postproc.worker import run_postproc
        run_postproc(cfg, index)
    elif role == "background":
        from sluice.app.background import run_background
        run_background(cfg)
    elif role == "grpc":
        from sluice.ingress.grpc.server import run_grpc
        run_grpc(cfg)
    else:
        raise ValueError(role)


def make_runtime_dir() -> str:
    return tempfile.mkdtemp(prefix="sluice-", dir=envs.runtime_base())  # mode 0700


_OWNER = "owner"


def claim(shm_dir: str) -> int:
    """Locks the shared-memory directory this server has just made, for as long as this process lives: the
    kernel drops the lock however the process ends, so a directory whose lock can be taken was left by a
    server killed outright."""
    fd = os.open(os.path.join(shm_dir, _OWNER + ".new"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, str(os.getpid()).encode())
    os.rename(os.path.join(shm_dir, _OWNER + ".new"), os.path.join(shm_dir, _OWNER))  # locked before it is seen
    return fd


def sweep_orphans() -> list[str]:
    """Removes what servers killed outright (SIGKILL, the OOM killer) left behind: their shared-memory files
    (a context worker's KV cache, which is RAM on tmpfs) and their runtime directories. A live server holds
    its directory's lock; another user's directories cannot be opened; both are left alone."""
    removed = []
    for shm_dir in glob.glob(os.path.join(shm_base(), "sluice-*")):
        try:
            fd = os.open(os.path.join(shm_dir, _OWNER), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(envs.runtime_base(), os.path.basename(shm_dir)), ignore_errors=True)
        os.close(fd)
        removed.append(shm_dir)
    return removed


class Supervisor:
    def __init__(self, cfg: ServerConfig, http: socket.socket | None = None) -> None:
        """`http`: the HTTP port held (sluice.base.ports.hold) until granian's workers are gone."""
        self.cfg, self._http = cfg, http
        self.config_path = str(Path(cfg.runtime_dir) / "config.json")
        cfg.dump(Path(self.config_path))
        os.makedirs(cfg.addresses.shm_dir, mode=0o700)
        self._owner = claim(cfg.addresses.shm_dir)
        if removed := sweep_orphans():
            log.info("removed %d directories that killed servers left in %s", len(removed), shm_base())
        metrics_dir = os.path.join(cfg.runtime_dir, "metrics")
        os.makedirs(metrics_dir)
        envs.set_prometheus_dir(metrics_dir)  # inherited by every stage and the granian workers
        envs.default_omp_wait_policy()  # before any stage starts (OpenMP reads it when it loads)
        self.stats = EngineStats(cfg.addresses.stats_path, create=True)
        self.clocks = StageClocks(cfg.addresses.stage_clocks_path, cfg.render_workers, cfg.postproc_workers,
                                  create=True)
        self._stalls: set[tuple[StageRole, int]] = set()  # the render / postproc workers now past their stall limit
        self.ctx = zmq.Context()
        self.inbox: PullChannel[SupervisorInput] = PullChannel(self.ctx, cfg.addresses.supervisor, SupervisorInput)
        self.control: PubChannel[ControlInput] = PubChannel(self.ctx, cfg.addresses.control)
        self.postprocs = [PushChannel[PostprocInput](self.ctx, cfg.addresses.postproc(k))
                          for k in range(cfg.postproc_workers)]
        self.stages: dict[tuple[str, int], BaseProcess] = {}
        self.granian: subprocess.Popen | None = None
        self.ingress_status: dict[int, tuple[float, int]] = {}  # pid -> (time, in flight)
        self._token_path: dict[tuple[str, int], int] = {}  # the engine's and the postproc workers' pids
        self._token_cpus: set[int] | None = None  # where they run (None: anywhere)
        affinity.listed_cpus(cfg.cpu_affinity)  # refuses CPUs this process may not use, now
        self._stop_requested = False

    # ---- start ----------------------------------------------------------------

    def _spawn(self, role: str, index: int) -> None:
        p = mp.get_context("spawn").Process(target=stage_main, args=(role, index, self.config_path),
                                            name=f"sluice-{role}-{index}")
        p.start()
        self.stages[(role, index)] = p

    def start_stages(self) -> None:
        roles = [("engine", 0)] + [("render", i) for i in range(self.cfg.render_workers)] + \
                [("postproc", k) for k in range(self.cfg.postproc_workers)] + [("background", 0)] + \
                ([("grpc", 0)] if self.cfg.grpc_port is not None else [])
        for role, index in roles:
            self._spawn(role, index)
        waiting = set(roles)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while waiting:
            if self._stop_requested:
                raise SystemExit(0)
            dead = [k for k, p in self.stages.items() if not p.is_alive()]
            if dead:
                raise SystemExit(f"sluice: {dead[0][0]}[{dead[0][1]}] exited during startup "
                                 f"(code {self.stages[dead[0]].exitcode})")
            if time.monotonic() > deadline:
                raise SystemExit(f"sluice: stages not ready after {_READY_TIMEOUT_S:.0f}s: {sorted(waiting)}")
            msg = self.inbox.get(timeout=0.2)
            if isinstance(msg, Ready):
                waiting.discard((msg.role, msg.index))
                log.info("%s[%d] ready (pid %d)", msg.role, msg.index, msg.pid)
                self._place(msg)
                if msg.role == "engine":
                    self._kv_ports(msg)

    def _kv_ports(self, ready: Ready) -> None:
        """The KV ports the engine bound (it picks those given as 0 in the bind itself) written to the config
        the ingress workers read (they advertise them to routers)."""
        self.cfg = msgspec.structs.replace(self.cfg, kv_events_port=ready.kv_events_port,
                                           kv_transfer_port=ready.kv_transfer_port)
        self.cfg.dump(Path(self.config_path))
        for name, port in (("KV events", ready.kv_events_port), ("KV transfer", ready.kv_transfer_port)):
            if port:
                log.info("%s on port %d", name, port)

    def _place(self, ready: Ready) -> None:
        """Pins the engine and the postproc workers to --cpu-affinity's CPUs (decided once the engine says
        whether it computes on the CPU; a postproc worker that was ready before, or is restarted, follows)."""
        if ready.role == "engine":
            c = self.cfg
            busy = 1 + c.render_workers + c.postproc_workers + c.ingress_workers
            self._token_cpus = affinity.token_path_cpus(c.cpu_affinity, busy, ready.cpu_compute)
            if self._token_cpus is not None:
                log.info("the engine and the postproc workers run on CPUs %s", sorted(self._token_cpus))
        if ready.role in ("engine", "postproc"):
            self._token_path[ready.role, ready.index] = ready.pid
            if self._token_cpus is not None:
                for pid in ([ready.pid] if ready.role == "postproc" else self._token_path.values()):
                    affinity.pin(pid, self._token_cpus)

    def start_ingress(self) -> None:
        c = self.cfg
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--workers",
               str(c.ingress_workers), "--loop", "uvloop", "--host", c.host, "--port", str(c.port), "--no-ws",
               "--respawn-failed-workers", "--respawn-interval", "0.5", "--log-level", "warning",
               *(["--process-name", "sluice: granian"] if procs.titles_supported() else []),
               *granian_args(c), "sluice.ingress.app:create_app"]
        env = dict(os.environ, SLUICE_CONFIG=self.config_path)
        supervisor = os.getpid()
        # Its own group: shutdown() can end granian's workers with it. Each worker dies with granian (create_app).
        def own_group() -> None:
            procs.die_with_parent(supervisor)
            os.setpgrp()

        self.granian = subprocess.Popen(cmd, env=env, preexec_fn=own_group)
        deadline = time.monotonic() + 60
        while not self._port_open():
            if self.granian is not None and self.granian.poll() is not None:
                raise SystemExit(f"sluice: the HTTP server exited during startup (code {self.granian.returncode})")
            if time.monotonic() > deadline:
                raise SystemExit("sluice: the HTTP server did not start listening within 60s")
            time.sleep(0.05)
        log.info("ingress ready (granian pid %d, %d workers) on http://%s:%d", self.granian.pid, c.ingress_workers,
                 c.host, c.port)

    def _port_open(self) -> bool:
        with socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET) as s:
            s.settimeout(0.2)
            return s.connect_ex((self.cfg.host, self.cfg.port)) == 0

    # ---- run ------------------------------------------------------------------

    def run(self) -> int:
        procs.set_title("sluice: supervisor")
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.start_stages()
            self.start_ingress()
            _sd_notify("READY=1")
            return self._watch()
        finally:
            self.shutdown()

    def _on_signal(self, signum, frame) -> None:
        self._stop_requested = True

    def _watch(self) -> int:
        watchdog = envs.watchdog_seconds()
        last_ping = 0.0
        while not self._stop_requested:
            self._poll_inbox(0.2)
            # Tell systemd we are alive only while the engine makes progress: a stuck engine gets restarted.
            if watchdog and time.monotonic() - last_ping >= watchdog / 2 and \
                    time.time() - self.stats.read()["heartbeat"] < self.cfg.stall_timeout:
                _sd_notify("WATCHDOG=1")
                last_ping = time.monotonic()
            dead = [k for k, p in self.stages.items() if not p.is_alive()]
            if ("engine", 0) in dead:
                log.error("engine died (exit code %s): failing in-flight requests and exiting",
                          self.stages[("engine", 0)].exitcode)
                self._fail_in_flight()
                return 1
            for role, index in dead:  # render / postproc: fail what it held; background: it resumes; restart it
                p = self.stages[(role, index)]
                log.error("%s[%d] (pid %d) died (exit code %s): restarting it", role, index, p.pid, p.exitcode)
                _forget_process(p.pid or 0)
                if role in ("render", "postproc"):  # (the background owner's requests: as a dead ingress worker's)
                    stage = cast(StageRole, role)
                    self.clocks.clear(stage, index)  # (watched again once the new one beats)
                    self.control.put(StageDied(stage, index))
                self._spawn(role, index)
            self._log_stalls()
            self._check_ingress_workers()
            if self.granian is not None and self.granian.poll() is not None:
                log.error("the HTTP server exited (code %s)", self.granian.returncode)
                return 1
        _sd_notify("STOPPING=1")
        self._drain()
        return 0

    def _log_stalls(self) -> None:
        """Says when a render or postproc worker passes its stall limit (/health and /ready answer 503 for as
        long), and when it is back."""
        c = self.cfg
        stalls = {(s.role, s.index): s for s in
                  self.clocks.stalled(stall_limits(c.stall_timeout, c.render_timeout, c.grammar_compile_timeout))}
        for key in stalls.keys() - self._stalls:
            log.error("%s[%d] has been on one job (or silent) for %.0fs, past its stall limit: /health and /ready "
                      "answer 503 until it is done", *key, stalls[key].seconds)
        for key in self._stalls - stalls.keys():
            log.info("%s[%d] is working again", *key)
        self._stalls = set(stalls)

    def _check_ingress_workers(self) -> None:
        """granian respawns a dead ingress worker; the requests it held are dropped here, in postproc."""
        for pid in list(self.ingress_status):
            if not os.path.exists(f"/proc/{pid}"):
                log.error("ingress worker %d died: dropping its requests", pid)
                del self.ingress_status[pid]
                _forget_process(pid)
                for channel in self.postprocs:
                    channel.put(IngressGone(self.cfg.addresses.ingress(pid)))

    def _poll_inbox(self, timeout: float) -> None:
        msg = self.inbox.get(timeout=timeout)
        while msg is not None:
            if isinstance(msg, IngressStatus):
                self.ingress_status[msg.pid] = (time.monotonic(), msg.in_flight)
            elif isinstance(msg, Ready):  # a restarted stage
                log.info("%s[%d] ready (pid %d)", msg.role, msg.index, msg.pid)
                self._place(msg)
            msg = self.inbox.get_nowait()

    def _fail_in_flight(self) -> None:
        self.stats.set(alive=0)
        self.control.put(EngineDied())
        time.sleep(_ERROR_FLUSH_S)  # let the ingress workers write the errors out

    def _drain(self) -> None:
        log.info("draining: waiting up to %.0fs for in-flight requests", self.cfg.shutdown_timeout)
        self.control.put(Drain())
        drain_started = time.monotonic()
        deadline = drain_started + self.cfg.shutdown_timeout
        background = self.stages[("background", 0)].pid  # its work resumes after the restart: no wait for it
        while time.monotonic() < deadline:
            self._poll_inbox(0.1)
            status = [v for pid, v in self.ingress_status.items() if pid != background]
            fresh = [n for t, n in status if t > drain_started]
            recent = [n for t, n in status if t > time.monotonic() - 1.0]
            if fresh and recent and all(n == 0 for n in recent):
                break
        else:
            log.warning("drain timed out: ending the remaining requests")
            self.control.put(DrainTimedOut(self.cfg.shutdown_timeout))
            time.sleep(_ERROR_FLUSH_S)  # let the ingress workers write the errors out

    def shutdown(self) -> None:
        if self.granian is not None:
            if self.granian.poll() is None:
                self.granian.terminate()
                try:
                    self.granian.wait(10)
                except subprocess.TimeoutExpired:
                    self.granian.kill()
            _kill_group(self.granian.pid)  # workers granian left behind (SO_REUSEPORT: they would share the port)
        for role in ("grpc", "background", "render", "engine", "postproc"):
            for p in (p for (r, _), p in self.stages.items() if r == role):
                if p.is_alive():
                    p.terminate()
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                if p.pid is not None:
                    _kill_group(p.pid)  # (a stage leads its own group: see stage_main)
        self.stats.close()
        self.clocks.close()
        if self._http is not None:
            self._http.close()
        shutil.rmtree(self.cfg.runtime_dir, ignore_errors=True)
        shutil.rmtree(self.cfg.addresses.shm_dir, ignore_errors=True)
        log.info("stopped")


def _forget_process(pid: int) -> None:
    """Drops a dead process's live gauges from the multiprocess metrics."""
    if envs.prometheus_dir():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def _sd_notify(state: str) -> None:
    path = envs.notify_socket()
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        s.sendall(state.encode())
