"""KV block reads between two processes, by transport: shm (engine/kv_transfer.py, tmpfs files mapped by the
reader) against NIXL (UCX backend; UCX_TLS picks its transport: tcp here) and Mooncake's transfer engine (TCP).

A "context" process holds a paged cache (LAYERS x K/V tensors of BLOCKS blocks) and registers it; the
reader reads batches of k blocks (scattered over the cache, so a batch is k runs of one block: the worst
case for a transport that moves runs) into its own cache. Prints bytes/s and the latency of one batch.

    python -m bench.kv_transfer --transports shm nixl mooncake --blocks 16 64 256
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

LAYERS, NUM_BLOCKS, BLOCK_ELEMS = 4, 1024, 16 * 8 * 64  # block_size 16, 8 KV heads, head_dim 64, float32


def _tensors(alloc) -> list[np.ndarray]:
    return [alloc(NUM_BLOCKS * BLOCK_ELEMS * 4) for _ in range(2 * LAYERS)]


def _holder(kind: str, q: mp.Queue, stop: Event) -> None:
    """The context side: a filled cache, registered with the transport; its location goes on `q`."""
    if kind == "shm":
        d = tempfile.mkdtemp(dir="/dev/shm")
        files = []
        for i in range(2 * LAYERS):
            path = os.path.join(d, f"kv-{i}")
            np.full(NUM_BLOCKS * BLOCK_ELEMS, i + 1, np.float32).tofile(path)
            files.append(path)
        q.put(files)
    elif kind == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("ctx", nixl_agent_config(backends=["UCX"]))
        bufs = [np.full(NUM_BLOCKS * BLOCK_ELEMS, i + 1, np.float32) for i in range(2 * LAYERS)]
        agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
        q.put((agent.get_agent_metadata(), [b.ctypes.data for b in bufs]))
    else:
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        bufs = [np.full(NUM_BLOCKS * BLOCK_ELEMS, i + 1, np.float32) for i in range(2 * LAYERS)]
        for b in bufs:
            assert engine.register_memory(b.ctypes.data, b.nbytes) == 0
        q.put((f"127.0.0.1:{engine.get_rpc_port()}", [b.ctypes.data for b in bufs]))
    stop.wait()


def _reader(kind: str, location) -> Callable[[list[int]], int]:
    """A function that reads (src block ids) into the same ids of a local cache; returns bytes moved."""
    width = BLOCK_ELEMS * 4
    local = [np.ones(NUM_BLOCKS * BLOCK_ELEMS, np.float32) for _ in range(2 * LAYERS)]  # (pages touched, as a cache's)
    if kind == "shm":
        import mmap

        maps = []
        for path in location:
            with open(path, "rb") as f:
                maps.append(np.frombuffer(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                                    prot=mmap.PROT_READ), np.uint8))
        dst = [t.view(np.uint8) for t in local]

        def read_shm(blocks: list[int]) -> int:
            for s, d in zip(maps, dst):
                for b in blocks:
                    d[b * width:(b + 1) * width] = s[b * width:(b + 1) * width]
            return len(blocks) * width * len(maps)
        return read_shm
    if kind == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config

        meta, addrs = location
        agent = nixl_agent("gen", nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(t.ctypes.data, t.nbytes, 0, "") for t in local], "DRAM")
        peer = agent.add_remote_agent(meta)

        def read_nixl(blocks: list[int]) -> int:
            rem = [(a + b * width, width, 0) for a in addrs for b in blocks]
            loc = [(t.ctypes.data + b * width, width, 0) for t in local for b in blocks]
            h = agent.initialize_xfer("READ", agent.get_xfer_descs(loc, "DRAM"), agent.get_xfer_descs(rem, "DRAM"),
                                      peer)
            state = agent.transfer(h)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            assert state == "DONE", state
            return len(rem) * width
        return read_nixl
    from mooncake.engine import TransferEngine

    peer, addrs = location
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    for t in local:
        engine.register_memory(t.ctypes.data, t.nbytes)

    def read_mooncake(blocks: list[int]) -> int:
        loc = [t.ctypes.data + b * width for t in local for b in blocks]
        rem = [a + b * width for a in addrs for b in blocks]
        assert engine.batch_transfer_sync_read(peer, loc, rem, [width] * len(loc)) == 0
        return len(loc) * width
    return read_mooncake


def measure(kind: str, batches: list[int], repeats: int) -> list[tuple[int, float, float]]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_holder, args=(kind, q, stop), daemon=True)
    p.start()
    try:
        read = _reader(kind, q.get(timeout=60))
        rng = np.random.default_rng(0)
        out = []
        for k in batches:
            read(list(range(k)))  # warm (connections, registrations)
            times, moved = [], 0
            for _ in range(repeats):
                blocks = rng.choice(NUM_BLOCKS, k, replace=False).tolist()
                t0 = time.perf_counter()
                moved += read(blocks)
                times.append(time.perf_counter() - t0)
            out.append((k, moved / sum(times), statistics.median(times)))
        return out
    finally:
        stop.set()
        p.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", nargs="+", default=["shm", "nixl", "mooncake"])
    ap.add_argument("--blocks", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(f"block = {LAYERS} layers x K/V x {BLOCK_ELEMS * 4 // 1024} KiB = {2 * LAYERS * BLOCK_ELEMS * 4 // 1024} KiB")
    print("| transport | blocks per batch | MB/s | batch latency p50 ms |")
    print("|---|---|---|---|")
    for kind in args.transports:
        try:
            rows = measure(kind, args.blocks, args.repeats)
        except Exception as e:  # a transport that does not install or run here: say what failed
            print(f"| {kind} | failed: {type(e).__name__}: {e} | | |")
            continue
        for k, rate, p50 in rows:
            print(f"| {kind} | {k} | {rate / 1e6:,.0f} | {p50 * 1000:.3f} |")


if __name__ == "__main__":
    main()
