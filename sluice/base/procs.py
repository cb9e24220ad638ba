"""What every process Sluice starts does first: say what it is (to ps, top, py-spy) and die with its parent."""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
from types import ModuleType

setproctitle: ModuleType | None
try:
    import setproctitle
except ImportError:  # (a dependency; without it, processes keep the interpreter's command line)
    setproctitle = None

_PR_SET_PDEATHSIG = 1


def titles_supported() -> bool:
    return setproctitle is not None


def set_title(title: str) -> None:
    """The command line ps shows for this process, e.g. `sluice: render 0` (a no-op where it cannot be set)."""
    if setproctitle is not None:
        # Keep /proc/<pid>/environ readable (a title then fits in the original command line, which ours do).
        os.environ.setdefault("SPT_NOENV", "1")
        setproctitle.setproctitle(title)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim_heap() -> None:
    """Gives the heap's free pages back to the OS. glibc keeps the chunks freed between live ones, and the
    free top of the heap below its trim threshold: what a burst of many small buffers held (a cut stream's
    frames) otherwise stays resident for good. A no-op without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def die_with_parent(parent: int | None = None) -> None:
    """Linux: SIGKILL this process when its parent dies, however it dies. `parent` is the pid that started
    it (default: the multiprocessing parent): a parent already gone before the request took hold is caught
    by comparing it with os.getppid(), which then names whoever adopted this process."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux / glibc
        return
    if parent is None:
        spawner = multiprocessing.parent_process()
        parent = spawner.pid if spawner is not None else os.getppid()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
