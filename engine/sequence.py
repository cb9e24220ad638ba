"""A request as the engine sees it."""
from __future__ import annotations

import enum

from ipc.messages import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "shard", "postproc_spec",
                 "arrival_time", "seed", "status", "block_table", "num_computed_tokens", "num_cached_tokens",
                 "started")

    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *, seed: int,
                 shard: int = 0, postproc_spec: bytes = b"", arrival_time: float = 0.0) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.shard = shard
        self.postproc_spec = postproc_spec
        self.arrival_time = arrival_time
        self.seed = seed
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0
        self.started = False  # the postproc shard has been told about it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
