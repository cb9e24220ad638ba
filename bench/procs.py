"""A server's processes as the OS sees them (/proc): who descends from whom, what ps shows, who is alive (for the
benchmarks' fault injection and soak, and the tests that watch a server's processes)."""
from __future__ import annotations

import os


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> set[int]:
    """Every living process below root (children, their children, ...)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    children: dict[int | None, list[int]] = {}
    for pid in pids:
        children.setdefault(parent_of(pid), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def title(pid: int) -> str:
    """The command line as `ps -o args` shows it ('' once the process is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits on an init that may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
