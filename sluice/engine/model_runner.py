"""Turns a scheduled batch into tensors, runs the model and samples."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable

import numpy as np
import torch

from sluice.base import procs
from sluice.engine.attention import AttentionGroup, AttentionMetadata, cache_row
from sluice.engine.backend import select_backend
from sluice.engine.logit_constraints import greedy_held, plain_greedy
from sluice.engine.prediction import verified
from sluice.engine.sampler import SamplingBatch, TokenLogprobs, logprobs_of, sample
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


@dataclass
class PromptLogprobChunk:
    seq: Sequence
    start: int  # prompt position of the first scored token (>= 1)
    entries: list[TokenLogprobs]


@dataclass
class StepSamples:
    tokens: list[int]  # one per sampling sequence, in batch order (`counts[i]` for the i-th, when set)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # aligned with tokens
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)
    counts: list[int] | None = None  # tokens per sampling sequence, in a step with drafts (engine/prediction.py)


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs: its tokens [T] at their positions [T], the attention metadata, and which
    rows are scored: the prompt rows first (prompt logprobs: (sequence, first position, count) each), then
    one row of each sequence that samples this step (a drafted one's: one after its last token and after
    each draft token, `ahead` 0, 1, ...)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [num_prompt_rows + len(sampling_seqs)]
    num_prompt_rows: int
    prompt_rows: list[tuple[Sequence, int, int]]
    sampling_seqs: list[Sequence]  # one per sampled row
    drafts: list[list[int]] | None = None  # per sampling sequence (in order, once each), its draft
    ahead: list[int] | None = None  # per sampled row: how many output tokens before it are its draft's


def kv_block_bytes(model: torch.nn.Module, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    layers, heads, dim = model.kv_shape
    layers = layers if num_layers is None else num_layers
    tensors = 1 if getattr(model, "latent_kv", False) else 2  # (a latent cache is its keys and its values)
    return tensors * layers * block_size * heads * cache_row(dtype, dim) * torch.empty((), dtype=dtype).element_size()


def kv_pools(model: torch.nn.Module) -> dict[int | None, str]:
    """Each attention window -> the Sequence table its KV blocks go in. Sliding-window layers beside
    full-attention ones (gpt-oss) keep theirs apart, so what falls out of the window can be freed."""
    windows = set(model.layer_windows)
    hybrid = None in windows and len(windows) > 1
    return {w: "window_table" if hybrid and w is not None else "block_table" for w in windows}


# Plain-greedy rows beside sampled ones in a step take the LM head's argmax path from this many up, where
# that path writes no logits (the CPU kernel: one read of the weight, then little a row); fewer ride the
# logits path with the sampled rows (a row's logits and the sampling pass over them; bench/RESULTS.md#cpu-kernels).
_SPLIT_GREEDY_MIN = 4


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_window_blocks: int = 0,
                 kv_alloc: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`num_window_blocks`: the size of the sliding-window layers' own pool, when they have one. `kv_alloc`:
        where the cache tensors go (zeroed, in kv_dtype), when a KV transport reads them (engine/kv_transfer.py).
        `kv_dtype`: the cache's (--kv-cache-dtype; None: the activations' dtype)."""
        self.model = model
        self.block_size = block_size
        self.tables = kv_pools(model)  # window -> the Sequence table its blocks are in
        self.windows = set(self.tables)
        self.hybrid = "window_table" in self.tables.values()
        # The window whose out-of-window blocks the scheduler frees (in the window pool when hybrid).
        self.sliding_window = next((w for w in self.windows if w is not None), None) \
            if self.hybrid or len(self.windows) == 1 else None
        self.device = device
        _, heads, dim = model.kv_shape
        dim = cache_row(kv_dtype or dtype, dim)
        # One (K, V) pair per layer: [blocks in its pool * block_size, Hkv, D] (one tensor twice: a latent cache;
        # an int8 cache's rows hold their scale after the D codes: attention.cache_row)
        self.kv_caches = []
        alloc = kv_alloc or (lambda shape: torch.zeros(shape, dtype=kv_dtype or dtype, device=device))
        for w in model.layer_windows:
            slots = (num_window_blocks if self.tables[w] == "window_table" else num_blocks) * block_size
            k = alloc((slots, heads, dim))
            self.kv_caches.append((k, k if getattr(model, "latent_kv", False) else alloc((slots, heads, dim))))
        # The model's ops on this device (engine/backend.py), its weights packed for them once, here. `one_call`:
        # whether a step runs through the layers in one call, which reads `AttentionMetadata.row_group`.
        self.backend = select_backend(device, dtype)
        self.one_call = self.backend.prepare(model, self.kv_caches)
        # (a table given to an earlier runner's head, Backend.give_table: that head, the table held only there)
        given = getattr(model, "given_head", None)
        self.lm_head = given if given is not None else self.backend.lm_head(model.lm_weight())
        self.backend.give_table(model, self.lm_head)  # (a backend whose head packed the table: held once)
        # (the weights loaded wider and packed narrower, or replaced by packed copies, left their memory in malloc's
        # heap: SmolLM2 in float32 905 -> 732 MB resident once it is given back)
        procs.trim_heap()
        # the model's own map of the LM head's logits (soft-capping, scaling): order-keeping, so greedy rows'
        # argmax path skips it
        self.finish_logits = getattr(model, "finish_logits", lambda logits: logits)
        self.exp_kernels = self.backend.exp_kernels()

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Float32 logits [B, V] for the sequences that sample this step, and those sequences."""
        hidden, inputs = self._hidden(batch)
        return self.finish_logits(self.lm_head(hidden)[inputs.num_prompt_rows:].float()), inputs.sampling_seqs

    def _hidden(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepInputs]:
        inputs = self._prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_index)
        return hidden, inputs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepSamples:
        """Runs one step: a sampled token for each sequence that samples, in batch order, and any logprobs."""
        hidden, inputs = self._hidden(batch)
        out = self._rows(hidden, inputs)
        return out if inputs.drafts is None else _kept(out, inputs.sampling_seqs, inputs.drafts)

    def _rows(self, hidden: torch.Tensor, inputs: StepInputs) -> StepSamples:
        """A token for each sampled row."""
        seqs, ahead = inputs.sampling_seqs, inputs.ahead
        if not inputs.prompt_rows:
            greedy = [plain_greedy(s) or greedy_held(s) for s in seqs]
            if all(greedy):
                # the argmax without the logits: the LM head's kernel need not write them (the same tokens)
                return self._settle_held(hidden, seqs, StepSamples(self.lm_head.argmax(hidden).tolist()))
            if sum(greedy) >= _SPLIT_GREEDY_MIN and self.lm_head.kernel is not None:
                return self._settle_held(hidden, seqs, self._split(hidden, seqs, greedy, ahead))
        return self._sample(hidden, seqs, inputs.num_prompt_rows, inputs.prompt_rows, ahead)

    def _settle_held(self, hidden: torch.Tensor, seqs: list[Sequence], out: StepSamples) -> StepSamples:
        """Greedy rows held by a grammar took the plain argmax: where the grammar allows it, it is their token
        (a held request then costs the batch no logits); the others take the logits path, masked."""
        held = [r for r, s in enumerate(seqs) if greedy_held(s)]
        if not held:
            return out
        grammars = {r: g for r in held if (g := seqs[r].grammar) is not None}
        refused = [r for r, g in grammars.items() if not g.allows(out.tokens[r])]
        for r, g in grammars.items():
            if r not in refused:
                g.observe(seqs[r].token_ids, out.tokens[r])
        if refused:
            again = self._sample(hidden[refused], [seqs[r] for r in refused], 0, [])
            for r, token in zip(refused, again.tokens):
                out.tokens[r] = token
        return out

    def _split(self, hidden: torch.Tensor, seqs: list[Sequence], greedy: list[bool],
               ahead: list[int] | None = None) -> StepSamples:
        """A step whose plain-greedy rows (`greedy[r]`) take the argmax path and the others the logits path:
        the tokens each path gives alone (a row's token depends on that row only)."""
        fast = [r for r, g in enumerate(greedy) if g]  # (held greedy rows too: _settle_held checks them)
        others = [r for r, g in enumerate(greedy) if not g]
        out = self._sample(hidden[others], [seqs[r] for r in others], 0, [],
                           None if ahead is None else [ahead[r] for r in others])
        tokens = [0] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs) if out.logprobs else []
        for r, token in zip(fast, self.lm_head.argmax(hidden[fast]).tolist()):
            tokens[r] = token
        for i, r in enumerate(others):
            tokens[r] = out.tokens[i]
            if out.logprobs:
                logprobs[r] = out.logprobs[i]
        return StepSamples(tokens, logprobs)

    def _sample(self, hidden: torch.Tensor, seqs: list[Sequence], split: int, prompt_rows: list,
                ahead: list[int] | None = None) -> StepSamples:
        """The logits path: hidden's first `split` rows are prompt rows scored for prompt logprobs
        (`prompt_rows`: (sequence, start, count) each), the rest one per sampled row (`ahead`: see StepInputs)."""
        logits = self.finish_logits(self.lm_head(hidden))
        prompt_logits, logits = logits[:split], logits[split:]
        tokens = sample(logits, SamplingBatch.for_seqs(seqs, self.device, self.exp_kernels, ahead))
        out = StepSamples(tokens.tolist())
        for seq, token in zip(seqs, out.tokens):
            if seq.grammar is not None:
                seq.grammar.observe(seq.token_ids, token)
        want = {r: k for r, s in enumerate(seqs) if (k := s.sampling.logprobs) is not None}
        if want:
            rows = torch.tensor(list(want), device=self.device)
            each = iter(logprobs_of(logits[rows], tokens[rows], max(want.values())))
            out.logprobs = [next(each) if s.sampling.logprobs is not None else None for s in seqs]
        offset = 0
        for seq, start, count in prompt_rows:
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + count], device=self.device)
            entries = logprobs_of(prompt_logits[offset : offset + count], targets, seq.sampling.prompt_logprobs or 0)
            out.prompt_logprobs.append(PromptLogprobChunk(seq, start + 1, entries))
            offset += count
        return out

    @torch.inference_mode()
    def warm_up(self, max_batched_tokens: int, max_seqs: int, max_len: int) -> float:
        """Runs the steps a server meets first, on scratch cache slots (every token in block 0, which the
        first request given it overwrites before reading): a prefill of the whole step budget, then decodes
        of 1, 16 and `max_seqs` rows, greedy and sampled. The first requests then do not pay for first
        calls (kernel loads, primitives built per shape, the heap growing to a step's size). Without it,
        the first load at concurrency 16 on a new server ran 10-15% slower than the next; with it, ~5%.
        Returns seconds."""
        t0 = time.perf_counter()
        bs = self.block_size

        def seq(length: int, temperature: float) -> Sequence:
            s = Sequence("warm-up", [0] * length, SamplingParams(max_tokens=1, temperature=temperature), seed=0)
            for name in self.tables.values():
                setattr(s, name, [0] * -(-length // bs))
            return s

        size = max(1, min(max_batched_tokens, max_len - 1))
        full, rest = divmod(max_batched_tokens, size)
        lengths = ([size] * full + [rest] * bool(rest))[:max_seqs]
        self.run(ScheduledBatch([seq(n, 0.0) for n in lengths], lengths))
        for rows in sorted({1, min(16, max_seqs), max_seqs}):
            for temperature in (0.0, 1.0):
                decodes = [seq(2, temperature) for _ in range(rows)]
                for s in decodes:
                    s.num_computed_tokens = 1
                self.run(ScheduledBatch(decodes, [1] * rows))
        return time.perf_counter() - t0

    def _prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's tensors. Per-token and per-key arrays are built with numpy over the whole batch; only
        what each sequence owns (its token ids, its block tables) is read one sequence at a time."""
        dev = self.device
        seqs = batch.seqs
        b = len(seqs)
        if max(batch.num_new_tokens) == 1 and all(s.num_computed_tokens + 1 == s.num_tokens for s in seqs):
            return self._prepare_decodes(seqs)
        counts = np.fromiter(batch.num_new_tokens, np.int64, b)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, b)
        offsets = np.cumsum(counts) - counts
        total = int(counts.sum())
        row_of = np.repeat(np.arange(b), counts)  # [T] the sequence of each token
        positions = np.arange(total) - offsets[row_of] + starts[row_of]
        tables = {w: _padded_tables([getattr(s, name) for s in seqs]) for w, name in self.tables.items()}
        ids, sampling_seqs = [], []
        logits_index: list[int] = []
        drafts = batch.drafts
        ahead: list[int] = []
        prompt_index: list[int] = []  # rows whose logits score the next prompt token
        prompt_rows: list[tuple[Sequence, int, int]] = []
        for i, (seq, start, n, offset) in enumerate(zip(seqs, starts.tolist(), counts.tolist(), offsets.tolist())):
            ids.extend(seq.token_ids[start : start + n])
            if drafts is not None and (draft := drafts[i]):  # its last token, then its draft's (rows of each)
                ids.extend(draft)
                logits_index.extend(range(offset, offset + n))
                sampling_seqs.extend([seq] * n)
                ahead.extend(range(n))
                continue
            if seq.scores_prompt and start < seq.num_prompt_tokens - 1:
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                prompt_index.extend(range(offset, offset + count))
                prompt_rows.append((seq, start, count))
            if batch.samples(i):
                logits_index.append(offset + n - 1)
                sampling_seqs.append(seq)
                ahead.append(0)
        decodes = counts == 1
        groups = [self._group(np.flatnonzero(rows), starts, counts, offsets, tables, total)
                  for rows in (decodes, ~decodes) if rows.any()]
        one_call = self.one_call and total * int((starts + counts).max()) <= _ROW_KEYS_MAX
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(tables, row_of, positions),
            groups=groups,
            num_tokens=total,
            row_group=self._row_group(tables, starts, starts + counts, row_of, positions) if one_call else None,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_index=torch.tensor(prompt_index + logits_index, dtype=torch.long, device=dev),
            num_prompt_rows=len(prompt_index),
            prompt_rows=prompt_rows,
            sampling_seqs=sampling_seqs,
            drafts=None if drafts is None else [d for d, sampled in zip(drafts, batch.sampled) if sampled],
            ahead=None if drafts is None else ahead,
        )

    def _group(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, offsets: np.ndarray,
               tables: dict[int | None, np.ndarray], num_tokens: int) -> AttentionGroup:
        """Attention metadata for the batch's sequences `rows` (decodes, or prefill chunks)."""
        dev = self.device
        starts, lens, offs = starts[rows], counts[rows], offsets[rows]
        q_max = int(lens.max())
        valid_q = np.arange(q_max)[None, :] < lens[:, None]  # [B, Q]
        q_index = np.where(valid_q, offs[:, None] + np.arange(q_max)[None, :], 0)  # pads read row 0...
        out_index = np.where(valid_q, q_index, num_tokens)  # ...and write to the dummy row
        q_pos = starts[:, None] + np.arange(q_max)[None, :]  # [B, Q] absolute positions
        kv_slots, masks = {}, {}
        for w, table in tables.items():
            slot_rows, k_pos = self._keys(table[rows], starts, starts + lens, w)
            mask = _attends(k_pos[:, None, :], q_pos[:, :, None], w)
            mask &= valid_q[:, :, None]
            mask[:, :, 0] |= ~valid_q  # a pad query attends to one key, so softmax stays finite
            kv_slots[w] = torch.from_numpy(slot_rows).to(dev)
            masks[w] = torch.from_numpy(mask).unsqueeze(1).to(dev)
        # Keys from position 0, none a window drops (a real query attends keys 0..its position; pad queries'
        # rows are thrown away): a kernel takes each sequence's first query position for the mask, and where
        # they are all 0 this is is_causal's top-left mask
        by_position = {w: w is None or int((starts + lens).max()) <= w for w in tables}
        return AttentionGroup(
            q_index=torch.from_numpy(q_index).to(dev),
            out_index=torch.from_numpy(out_index).to(dev),
            kv_slots=kv_slots,
            masks=masks,
            by_position=by_position,
            q_starts=torch.from_numpy(starts.astype(np.int64)),
        )

    def _row_group(self, tables: dict[int | None, np.ndarray], starts: np.ndarray, ends: np.ndarray,
                   row_of: np.ndarray | None, positions: np.ndarray) -> AttentionGroup:
        """Every row of the step as a query of its own over its sequence's keys (sequence `row_of[t]`, each
        sequence's tokens starts..ends-1), causally masked: a decode step's one group, and for a step with
        prefill chunks what a one-call step reads (each chunk row as a decode of its position). row_of
        None: each sequence has one row."""
        dev, total = self.device, len(positions)
        kv_slots, masks = {}, {}
        for w, table in tables.items():
            slot_rows, k_pos = self._keys(table, starts, ends, w)
            if row_of is not None:
                slot_rows, k_pos = slot_rows[row_of], k_pos[row_of]
            kv_slots[w] = torch.from_numpy(slot_rows).to(dev)
            masks[w] = torch.from_numpy(_attends(k_pos, positions[:, None], w)).view(total, 1, 1, -1).to(dev)
        rows = torch.arange(total, device=dev).view(total, 1)
        return AttentionGroup(q_index=rows, out_index=rows, kv_slots=kv_slots, masks=masks)

    def _slot_mapping(self, tables: dict[int | None, np.ndarray], row_of: np.ndarray,
                      positions: np.ndarray) -> dict[int | None, torch.Tensor]:
        """Each window's cache slot [T] of each new token (sequence `row_of[t]`, at `positions[t]`)."""
        bs = self.block_size
        return {w: torch.from_numpy(t[row_of, positions // bs] * bs + positions % bs).to(self.device)
                for w, t in tables.items()}

    def _prepare_decodes(self, seqs: list[Sequence]) -> StepInputs:
        """`_prepare` for a step whose every sequence decodes one token and samples (most steps): the same
        tensors from a third of the numpy calls."""
        b, dev = len(seqs), self.device
        positions = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, b)
        tables = {w: _padded_tables([getattr(s, name) for s in seqs]) for w, name in self.tables.items()}
        group = self._row_group(tables, positions, positions + 1, None, positions)
        return StepInputs(
            input_ids=torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=AttentionMetadata(slot_mapping=self._slot_mapping(tables, np.arange(b), positions), groups=[group],
                                   num_tokens=b, row_group=group),
            logits_index=group.q_index.view(-1),
            num_prompt_rows=0,
            prompt_rows=[],
            sampling_seqs=seqs,
        )

    def _keys(self, table: np.ndarray, starts: np.ndarray, ends: np.ndarray,
              window: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(cache slots [B, K], their positions [B, K]) of the keys that the queries of each row's positions
        starts..ends-1 may attend to, from its block table (rows of `table`): with a window, from the first
        block it still reaches. Slots of blocks past a row's last are 0 (every query's causal mask drops them)."""
        bs, b = self.block_size, len(table)
        first = np.maximum(starts - window + 1, 0) // bs if window else np.zeros(b, dtype=np.int64)
        last = -(-ends // bs)  # one past each row's last block
        blocks = first[:, None] + np.arange(int((last - first).max()))[None, :]  # [B, blocks]
        live = blocks < last[:, None]
        block_ids = table[np.arange(b)[:, None], np.minimum(blocks, table.shape[1] - 1)]
        slot_rows = np.where(live[:, :, None], block_ids[:, :, None] * bs + np.arange(bs), 0).reshape(b, -1)
        return slot_rows, first[:, None] * bs + np.arange(slot_rows.shape[1])[None, :]


def _kept(out: StepSamples, seqs: list[Sequence], drafts: list[list[int]]) -> StepSamples:
    """A step with drafts: of each drafted sequence's rows (`seqs` holds one per sampled row), the tokens it
    keeps (engine/prediction.py verified), with their logprobs; `counts` says how many each."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    counts: list[int] = []
    r = 0
    for draft in drafts:
        seq = seqs[r]
        kept = verified(out.tokens[r : r + len(draft) + 1], draft, seq.sampling.stop_token_ids)
        tokens += kept
        if out.logprobs:
            logprobs += out.logprobs[r : r + len(kept)]
        counts.append(len(kept))
        r += len(draft) + 1
    return StepSamples(tokens, logprobs, out.prompt_logprobs, counts)


def _attends(k_pos: np.ndarray, q_pos: np.ndarray, window: int | None) -> np.ndarray:
    """Whether a query at q_pos attends to a key at k_pos (broadcast): causal, and within the window."""
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return mask


# Rows x keys above which a step with prefill chunks is not offered as one group of single queries (its
# [T, K] slots and mask grow as the square of a long prompt's chunk, which torch's attention takes better).
_ROW_KEYS_MAX = 1 << 16


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """Block tables [B, longest] (padded with 0) from each sequence's list."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    out = np.zeros((len(tables), max(int(lens.max(initial=0)), 1)), dtype=np.int64)
    out[np.arange(out.shape[1])[None, :] < lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64,
                                                                        int(lens.sum()))
    return out
