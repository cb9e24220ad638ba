"""A request's choice as the engine sees it: one Sequence per choice."""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from sluice.ipc.messages import SamplingParams

if TYPE_CHECKING:
    from sluice.engine.grammar import GrammarState
    from sluice.engine.prediction import Prediction

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = ("request_id", "index", "leader", "token_ids", "num_prompt_tokens", "sampling", "shard",
                 "postproc_spec", "arrival_time", "seed", "priority", "cache_salt", "order", "status", "block_table",
                 "window_table", "num_registered_window_blocks",
                 "block_hashes", "num_registered_blocks", "num_computed_tokens", "num_cached_tokens", "started",
                 "grammar", "render_done_time", "first_scheduled_time", "first_token_time", "last_token_time",
                 "export", "prediction")

    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *, seed: int,
                 shard: int = 0, postproc_spec: bytes = b"", arrival_time: float = 0.0, priority: int = 0,
                 cache_salt: str = "", index: int = 0, leader: "Sequence | None" = None) -> None:
        self.request_id = request_id
        self.index = index  # the choice this sequence samples
        self.leader = leader  # choice 0, whose cached prompt the other choices reuse
        self.token_ids = list(prompt_ids)  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.shard = shard
        self.postproc_spec = postproc_spec
        self.arrival_time = arrival_time
        self.seed = seed
        self.priority = priority
        self.cache_salt = cache_salt
        self.order = (priority, next(_arrivals))  # admission order; preemption takes the largest
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.window_table: list[int] = []  # sliding-window layers' blocks, when they have a pool of their own
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_registered_window_blocks = 0
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
        self.started = False  # the postproc shard has been told about it
        self.grammar: GrammarState | None = None  # when the output is constrained
        self.render_done_time = 0.0
        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.export = False  # a context_only choice: after its first token its KV leaves for a generation worker
        self.prediction: Prediction | None = None  # the client's predicted output, drafted while it decodes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence reports prompt logprobs (choice 0 does it for the request)."""
        return self.sampling.prompt_logprobs is not None and self.index == 0

    def prefilling(self) -> bool:
        return self.status is not Status.FINISHED and self.num_computed_tokens < self.num_prompt_tokens
