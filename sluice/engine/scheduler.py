"""Continuous batching under a per-step token budget, by priority.

Each step serves running sequences first (decodes, and the next chunks of
partially computed prompts), then admits waiting ones, in (priority, arrival)
order, while the budget, the sequence limit and the KV cache allow, reusing
cached prefix blocks. When the cache cannot hold what a sequence needs, the
running sequence with the lowest priority (the newest among equals) is
preempted: its blocks are freed and it is recomputed later, through the prefix
cache, from its tokens so far.
"""
from __future__ import annotations

import bisect
import operator
import time
from dataclasses import dataclass, field

from sluice.engine.block_manager import BlockManager
from sluice.engine.prediction import num_accepted
from sluice.engine.sequence import Sequence, Status
from sluice.ipc.messages import FinishReason

_RUNNING = Status.RUNNING  # (a module global: an enum member's lookup on its class is a descriptor call)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, this step (a drafted one's: its last token and its draft)
    # per sequence, the tokens of its prediction it runs after its last token (engine/prediction.py); None: none
    drafts: list[list[int]] | None = None
    # per sequence: its next token is sampled this step (its tokens are all computed), as scheduled
    sampled: list[bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sampled = [s.num_computed_tokens + n == len(s.token_ids) for s, n in zip(self.seqs, self.num_new_tokens)]
        if self.drafts is not None:
            for i, draft in enumerate(self.drafts):
                if draft:
                    self.sampled[i] = True

    def samples(self, i: int) -> bool:
        """Whether sequence i's next token is sampled this step (its tokens are all computed)."""
        return self.sampled[i]


@dataclass
class StepResult:
    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    exported: list[tuple[Sequence, int]] = field(default_factory=list)  # parked on their first token, blocks kept
    exported_rows: list[int] = field(default_factory=list)  # each exported one's index among the step's samples
    predictions: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (drafted, accepted, rejected)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which were found


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, sliding_window: int | None = None,
                 window_pool: BlockManager | None = None, max_draft_tokens: int = 8) -> None:
        """`sliding_window`: with no `window_pool`, every layer's window (the one pool frees what falls
        out of it); with a `window_pool`, the window of the layers whose KV lives there. `max_draft_tokens`:
        the most tokens of a prediction a decoding sequence runs in a step (0: none)."""
        self.bm = block_manager
        self.window_pool = window_pool
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_draft_tokens = max_draft_tokens
        self.waiting: list[Sequence] = []  # sorted by seq.order
        self.running: list[Sequence] = []  # sorted by seq.order
        self.stats = SchedulerStats()
        self._by_id: dict[str, list[Sequence]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def tail_tokens(self) -> int:
        """A prompt whose last chunk would be this many tokens or fewer takes it in the step before, over the
        budget: a step reads every weight and the prompt's keys whatever its size, so a step for a small tail
        costs several times its tokens (bench/JOURNAL.md, "a long prompt's prefill"). 0 with a sliding window,
        whose pool holds a window and one budget."""
        return 0 if self.sliding_window else self.max_num_batched_tokens // 8

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a step takes: the budget, and a prompt's tail."""
        return self.max_num_batched_tokens + self.tail_tokens

    def add(self, seq: Sequence) -> None:
        group = self._by_id.setdefault(seq.request_id, [])
        assert all(s.index != seq.index for s in group), f"duplicate request {seq.request_id}/{seq.index}"
        group.append(seq)
        bisect.insort(self.waiting, seq, key=_order)

    def abort(self, request_id: str, choice: int = -1) -> list[Sequence]:
        group = [s for s in self._by_id.get(request_id, ()) if choice in (-1, s.index)]
        for seq in group:
            self._finish(seq)
        return group

    # ---- one step -----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._step: dict[Sequence, int] = {}  # this step's sequences and their token counts, in order
        self._budget = self.max_num_batched_tokens
        tail = self.tail_tokens  # (a prompt takes all it has left when that is within the budget and a tail)
        bm, window_pool, window, step = self.bm, self.window_pool, self.sliding_window, self._step
        # (once a step for every running sequence: the budget in a local, bm.has_room inline)
        block_size, budget = bm.block_size, self._budget
        drafts: dict[Sequence, list[int]] = {}
        for seq in list(self.running):
            if seq.status is not _RUNNING or budget <= 0:
                continue
            computed = seq.num_computed_tokens
            u = len(seq.token_ids) - computed
            n = u if u <= budget + tail else budget
            if u == 1 and seq.prediction is not None and (draft := self._draft(seq, budget)):
                drafts[seq] = draft
                n += len(draft)
            if window:  # this step's first query sees keys from here on
                (window_pool or bm).free_outside_window(seq, computed - window + 1)
            if (computed + n > len(seq.block_table) * block_size
                    or window_pool is not None and not window_pool.has_room(seq, n)):
                self._budget = budget
                fits = self._make_room(seq, n, [])  # (gives back the budget of what it preempts)
                budget = self._budget
                if not fits:
                    continue  # seq itself was preempted
                self._allocate(seq, n, [])
            step[seq] = n
            budget -= n
        self._budget = budget
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs and self._budget > 0:
            seq = self.waiting[i]
            if seq.leader is not None and seq.leader.prefilling() and self.bm.enable_prefix_caching:
                i += 1  # wait for the leader's prompt to be cached, then reuse it
                continue
            hits, window_hits = self._prefix_hits(seq)
            u = seq.num_tokens - len(hits) * self.bm.block_size
            n = u if u <= self._budget + tail else self._budget
            if not self._make_room(seq, n, hits, window_hits):
                break
            self.waiting.remove(seq)
            self._allocate(seq, n, hits, window_hits)
            if seq.num_cached_tokens is None:
                seq.first_scheduled_time = time.time()
                seq.num_cached_tokens = len(hits) * self.bm.block_size
                self.stats.prefix_queries += seq.num_prompt_tokens
                self.stats.prefix_hits += seq.num_cached_tokens
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=_order)
            step[seq] = n
            self._budget -= n
        self._step = {}
        if not step:
            return None
        if drafts:
            return ScheduledBatch(list(step), list(step.values()), [drafts.get(s, []) for s in step])
        return ScheduledBatch(list(step), list(step.values()))

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """The tokens of seq's prediction it runs this step after its last one: within the budget, its
        max_tokens and max_model_len (so only a stop token ends it before its last), past its min_tokens, and
        in blocks it has or that are free (a draft never preempts)."""
        assert seq.prediction is not None  # (a sequence with a prediction)
        sp, num_tokens = seq.sampling, len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output < sp.min_tokens:
            return []
        k = min(self.max_draft_tokens, budget - 1, sp.max_tokens - num_output - 1, self.max_model_len - num_tokens - 1)
        draft = seq.prediction.draft(k)
        if draft and not (self.bm.can_allocate(seq, 1 + len(draft)) and
                          (self.window_pool is None or self.window_pool.can_allocate(seq, 1 + len(draft)))):
            return []
        return draft

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], tuple[list[int], int]]:
        """Cached blocks of seq's prompt: the main pool's, and (when the window layers keep a pool of their
        own) that pool's last blocks before them, with the index of the first: a hit is only as long as
        both pools have what the next token attends to."""
        hits = self.bm.cached_prefix(seq)
        if self.window_pool is None:
            return hits, ([], 0)
        bs, window = self.bm.block_size, self.sliding_window
        assert window is not None  # (a window pool serves sliding-window layers)
        for k in range(len(hits), 0, -1):
            first = max(0, k * bs - (window - 1)) // bs
            tail = self.window_pool.cached_blocks(seq, first, k)
            if tail is not None:
                return hits[:k], (tail, first)
        return [], ([], 0)

    def _make_room(self, seq: Sequence, n: int, hits: list[int], window_hits=([], 0)) -> bool:
        """Preempts lower-priority running sequences until seq fits; False if seq cannot (or was preempted)."""
        while not (self.bm.can_allocate(seq, n, hits) and
                   (self.window_pool is None or self.window_pool.can_allocate(seq, n, *window_hits))):
            victim = max(self.running, key=_order, default=None)
            if victim is None or (seq.status is Status.WAITING and victim.order < seq.order):
                return False
            self._preempt(victim)
            self._budget += self._step.pop(victim, 0)  # out of this step too, if it was already in
            if victim is seq:
                return False
        return True

    def _allocate(self, seq: Sequence, n: int, hits: list[int], window_hits=([], 0)) -> None:
        if self.window_pool is not None:
            self.window_pool.allocate(seq, n, *window_hits)
        self.bm.allocate(seq, n, hits)  # last: it sets the computed-token count

    def _deallocate(self, seq: Sequence) -> None:
        if self.window_pool is not None:
            self.window_pool.deallocate(seq)
        self.bm.deallocate(seq)  # last: it resets the computed-token count

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._deallocate(seq)
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_order)
        self.stats.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: list[int], counts: list[int] | None = None) -> StepResult:
        """Applies one step: `sampled` holds a token for each sequence that samples, in order, or `counts[i]`
        tokens for the i-th (a drafted sequence's: the draft tokens it kept, then the one after them)."""
        result = StepResult()
        new_tokens = result.new_tokens
        it = iter(sampled)
        row = 0  # the index in `sampled` of the next token taken from `it`
        each = iter(counts) if counts is not None else None
        drafts = batch.drafts
        now = time.time()
        bs = self.bm.block_size
        caching = [pool for pool in (self.bm, self.window_pool) if pool is not None and pool.enable_prefix_caching]
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.sampled)):
            if drafts is not None and drafts[i]:
                count = next(each) if each is not None else 1
                self._verified(seq, drafts[i], [next(it) for _ in range(count)], result, caching, now)
                row += count
                continue
            seq.num_computed_tokens += n
            # a block filled up, for the prefix cache (the window pool's count of them follows the primary's)
            if seq.num_computed_tokens // bs > seq.num_registered_blocks:
                for pool in caching:
                    pool.register_full_blocks(seq)
            if not samples:
                continue
            token = next(it)
            row += 1
            if each is not None:
                next(each)  # (1)
            seq.token_ids.append(token)
            if seq.prediction is not None:
                seq.prediction.advance(seq.token_ids, seq.num_prompt_tokens, 1)
            seq.last_token_time = now
            if not seq.first_token_time:
                seq.first_token_time = now
            if seq.export:  # its KV goes to a generation worker: out of the batch, its blocks kept
                self._finish(seq, keep_blocks=True)
                result.exported.append((seq, token))
                result.exported_rows.append(row - 1)
                continue
            new_tokens.append((seq, token))
            sp, num_tokens = seq.sampling, len(seq.token_ids)
            if (seq.grammar is None and token not in sp.stop_token_ids and num_tokens < self.max_model_len
                    and num_tokens - seq.num_prompt_tokens < sp.max_tokens):
                continue  # what finish_reason says of most tokens (None), sooner
            reason = self.finish_reason(seq, token)
            if reason is not None:
                self._finish(seq)
                result.finished.append((seq, reason))
        return result

    def _verified(self, seq: Sequence, draft: list[int], tokens: list[int], result: StepResult,
                  caching: list[BlockManager], now: float) -> None:
        """Applies a drafted sequence's step: `tokens` are the draft's tokens it kept, then the one sampled after
        them. The cache holds the KV of its tokens but the last, whatever else the step wrote past them (the
        rejected draft tokens' slots, which the next step overwrites)."""
        assert seq.prediction is not None  # (a drafted sequence)
        seq.token_ids.extend(tokens)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        if seq.num_computed_tokens // self.bm.block_size > seq.num_registered_blocks:
            for pool in caching:
                pool.register_full_blocks(seq)
        seq.last_token_time = now
        accepted = num_accepted(tokens, draft)
        seq.prediction.verified(accepted, len(draft))
        result.predictions.append((seq, accepted, len(draft) - accepted))
        seq.prediction.advance(seq.token_ids, seq.num_prompt_tokens, len(tokens))
        for j, token in enumerate(tokens):
            result.new_tokens.append((seq, token))
            # (the draft's length keeps max_tokens and max_model_len to the last token; only a stop token ends
            # the output, and the runner kept none after one)
            reason = self.finish_reason(seq, token) if j == len(tokens) - 1 or token in seq.sampling.stop_token_ids \
                else None
            if reason is not None:
                assert j == len(tokens) - 1, "a drafted step kept tokens after its end"
                self._finish(seq)
                result.finished.append((seq, reason))

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Whether `token`, just appended to the choice's tokens, ends it (and why). (update() skips this call
        for a token it can tell ends nothing: keep its check in step with these.)"""
        sp = seq.sampling
        num_tokens = len(seq.token_ids)
        grammar = seq.grammar
        if grammar is not None and grammar.terminated:  # ends the output whatever min_tokens says
            return "stop_token" if token in sp.stop_token_ids else "grammar"
        # a stop id that a grammar took before its end is part of the output (the grammar allowed it as text)
        as_text = grammar is not None and grammar.active and grammar.taken == token
        if token in sp.stop_token_ids and not as_text and num_tokens - seq.num_prompt_tokens > sp.min_tokens:
            return "stop_token"
        if num_tokens - seq.num_prompt_tokens >= sp.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence whose blocks are allocated and whose prompt is computed (its KV imported from a
        context worker): it decodes from the next step."""
        self._by_id.setdefault(seq.request_id, []).append(seq)
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=_order)

    def release(self, seq: Sequence) -> None:
        """Frees the blocks of a sequence that is not (or no longer) scheduled: a parked one, an import's."""
        self._deallocate(seq)

    def _finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if not keep_blocks:
            self._deallocate(seq)
        seq.status = Status.FINISHED
        group = self._by_id[seq.request_id]
        group.remove(seq)
        if not group:
            del self._by_id[seq.request_id]


_order = operator.attrgetter("order")
