"""sluice/procs.py: a process names itself for ps, and dies with the process that started it, even one that
died before it could ask."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.procs import alive
from sluice.base import procs

ROOT = Path(__file__).resolve().parent.parent


def _python(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not procs.titles_supported(), reason="setproctitle is not installed")
def test_a_title_is_what_ps_shows():
    code = "from sluice.base import procs; procs.set_title('sluice: test'); print(open('/proc/self/cmdline').read())"
    out, _ = _python("-c", code).communicate(timeout=30)
    assert out.replace("\0", " ").strip() == "sluice: test"


def test_a_process_whose_parent_is_already_gone_kills_itself():
    """Its parent's death came before the request: os.getppid() names whoever adopted it, not its parent."""
    child = _python("-c", "from sluice.base import procs; procs.die_with_parent(parent=1); print('still alive')")
    out, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL and "still alive" not in out


_PARENT = """import multiprocessing as mp, time
from sluice.base import procs

def child():
    procs.die_with_parent()
    time.sleep(60)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child)
    p.start()
    print(p.pid, flush=True)
    time.sleep(60)
"""


def test_a_spawned_process_dies_when_its_parent_is_killed(tmp_path):
    (tmp_path / "parent.py").write_text(_PARENT)  # (spawn imports the target from the parent's main file)
    parent = _python(str(tmp_path / "parent.py"))
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # (the child has started and asked by now)
        assert alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_what_a_killed_server_left_in_shared_memory_is_swept_and_nothing_else():
    """A server's supervisor holds a lock on its shared-memory directory while it lives (sluice/supervisor.py
    claim): the next server removes the directories whose lock it can take (and their runtime directories),
    never a live server's, nor one without an owner file (one being made, or an older version's)."""
    from sluice.app.supervisor import sweep_orphans
    from sluice.base import envs
    from sluice.ipc.shm import shm_base

    made = {}
    for name in ("dead", "live", "ownerless"):
        made[name] = Path(shm_base()) / f"sluice-test{name}{os.getpid()}"
        made[name].mkdir()
        (made[name] / "kv-0").write_bytes(b"\0" * 4096)
    runtime = Path(envs.runtime_base()) / made["dead"].name
    runtime.mkdir()
    holder = _python("-c", f"from sluice.app.supervisor import claim; claim({str(made['live'])!r}); "
                     "print('ok', flush=True); import time; time.sleep(60)")
    try:
        assert holder.stdout.readline().strip() == "ok"
        dead = _python("-c", f"from sluice.app.supervisor import claim; claim({str(made['dead'])!r})")
        assert dead.wait(30) == 0  # (its lock went with it)
        removed = sweep_orphans()
        assert str(made["dead"]) in removed and not made["dead"].exists() and not runtime.exists()
        assert (made["live"] / "kv-0").exists() and (made["ownerless"] / "kv-0").exists()
        assert str(made["live"]) not in sweep_orphans()
    finally:
        holder.kill()
        holder.wait()
        for d in made.values():
            subprocess.run(["rm", "-rf", str(d)], check=False)
