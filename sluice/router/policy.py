"""Which worker takes a request: the KV index of every worker's cached blocks, and a cost of the prompt
blocks a worker would have to compute against the work it already has (the shape Dynamo's KV router and
SGLang's cache-aware policy use), with a balance guard when load is skewed."""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

from sluice.ipc.kv import KvEvents


class KvIndex:
    """Which worker holds which block hashes, from their engines' events."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}

    def apply(self, worker: str, events: KvEvents) -> None:
        held = self.held.setdefault(worker, set())
        if events.snapshot:
            held.clear()
        held.update(events.stored)
        held.difference_update(events.removed)

    def clear(self, worker: str) -> None:
        self.held.pop(worker, None)

    def overlap(self, worker: str, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt the worker holds (hashes chain, so a prefix is all there is)."""
        held = self.held.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


@dataclass
class Load:
    """What the router has sent a worker and not yet seen end."""

    in_flight: int = 0
    blocks: int = 0  # the prompt blocks those requests compute there (not cached there), plus one each

    def add(self, blocks: int) -> None:
        self.in_flight += 1
        self.blocks += blocks

    def done(self, blocks: int) -> None:
        self.in_flight -= 1
        self.blocks -= blocks


def _rank(key: str, worker: str) -> bytes:
    """A worker's place in a key's rendezvous order: each key its own, stable while workers come and go."""
    return hashlib.blake2b(f"{key}\0{worker}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Choice:
    worker: str
    overlap: int  # blocks of the prompt it holds
    reason: str  # kv, round_robin, balance


@dataclass
class Policy:
    kind: str = "kv"
    overlap_weight: float = 1.0
    balance_abs: int = 16
    balance_rel: float = 1.5
    _turn: itertools.count = field(default_factory=itertools.count)

    def choose(self, workers: list[str], hashes: list[bytes], index: KvIndex, loads: dict[str, Load],
               affinity: str | None = None) -> Choice:
        """`affinity`: the client's prompt_cache_key. Requests with one key go to one worker (the first in the
        key's rendezvous order) wherever the cache and the load leave a choice; without one, ties go round."""
        assert workers, "no worker to choose from"
        if affinity is None:
            start = next(self._turn)
            rotated = [workers[(start + i) % len(workers)] for i in range(len(workers))]  # ties go round in turn
        else:
            rotated = sorted(workers, key=lambda w: _rank(affinity, w))
        overlap = {w: index.overlap(w, hashes) for w in rotated}
        if self.kind == "round_robin":
            return Choice(rotated[0], overlap[rotated[0]], "round_robin")
        busy = {w: loads.get(w, Load()).in_flight for w in rotated}
        least, most = min(busy.values()), max(busy.values())
        if most - least > self.balance_abs and most > self.balance_rel * least:
            w = min(rotated, key=lambda w: busy[w])
            return Choice(w, overlap[w], "balance")
        cost = {w: self.overlap_weight * (len(hashes) - overlap[w]) + loads.get(w, Load()).blocks for w in rotated}
        w = min(rotated, key=lambda w: cost[w] if affinity is not None else (cost[w], busy[w]))
        return Choice(w, overlap[w], "kv")
