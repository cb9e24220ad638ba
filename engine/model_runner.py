"""Turns a scheduled batch into tensors, runs the model and samples."""
from __future__ import annotations

import numpy as np
import torch

from dataclasses import dataclass, field

from engine.attention import AttentionGroup, AttentionMetadata
from engine.lm_head import LMHead
from engine.sampler import SamplingBatch, TokenLogprobs, logprobs_of, plain_greedy, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass
class PromptLogprobChunk:
    seq: Sequence
    start: int  # prompt position of the first scored token (>= 1)
    entries: list[TokenLogprobs]


@dataclass
class StepSamples:
    tokens: list[int]  # one per sampling sequence, in batch order
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # aligned with tokens
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)


def kv_block_bytes(model: torch.nn.Module, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    layers, heads, dim = model.kv_shape
    layers = layers if num_layers is None else num_layers
    return 2 * layers * block_size * heads * dim * torch.empty((), dtype=dtype).element_size()


def kv_pools(model: torch.nn.Module) -> dict[int | None, str]:
    """Each attention window -> the Sequence table its KV blocks go in. Sliding-window layers beside
    full-attention ones (gpt-oss) keep theirs apart, so what falls out of the window can be freed."""
    windows = set(model.layer_windows)
    hybrid = None in windows and len(windows) > 1
    return {w: "window_table" if hybrid and w is not None else "block_table" for w in windows}


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_window_blocks: int = 0) -> None:
        """`num_window_blocks`: the size of the sliding-window layers' own pool, when they have one."""
        self.model = model
        self.lm_head = LMHead(model.lm_weight())
        self.block_size = block_size
        self.tables = kv_pools(model)  # window -> the Sequence table its blocks are in
        self.windows = set(self.tables)
        self.hybrid = "window_table" in self.tables.values()
        # The window whose out-of-window blocks the scheduler frees (in the window pool when hybrid).
        self.sliding_window = next((w for w in self.windows if w is not None), None) \
            if self.hybrid or len(self.windows) == 1 else None
        self.device = device
        _, heads, dim = model.kv_shape
        # One (K, V) pair per layer: [blocks in its pool * block_size, Hkv, D]
        self.kv_caches = []
        for w in model.layer_windows:
            slots = (num_window_blocks if self.tables[w] == "window_table" else num_blocks) * block_size
            self.kv_caches.append((torch.zeros(slots, heads, dim, dtype=dtype, device=device),
                                   torch.zeros(slots, heads, dim, dtype=dtype, device=device)))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Float32 logits [B, V] for the sequences that sample this step, and those sequences."""
        logits, inputs = self._forward(batch)
        return logits[inputs["num_prompt_rows"]:].float(), inputs["sampling_seqs"]

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, dict]:
        hidden, inputs = self._hidden(batch)
        return self.lm_head(hidden), inputs

    def _hidden(self, batch: ScheduledBatch) -> tuple[torch.Tensor, dict]:
        inputs = self._prepare(batch)
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"],
                            inputs["logits_index"])
        return hidden, inputs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepSamples:
        """Runs one step: a sampled token for each sequence that samples, in batch order, and any logprobs."""
        hidden, inputs = self._hidden(batch)
        seqs = inputs["sampling_seqs"]
        if not inputs["prompt_rows"] and all(map(plain_greedy, seqs)):
            # the argmax without the logits: the LM head's kernel need not write them (the same tokens)
            return StepSamples(self.lm_head.argmax(hidden).tolist())
        logits = self.lm_head(hidden)
        split = inputs["num_prompt_rows"]
        prompt_logits, logits = logits[:split], logits[split:]
        tokens = sample(logits, SamplingBatch.for_seqs(seqs, self.device))
        out = StepSamples(tokens.tolist())
        for seq, token in zip(seqs, out.tokens):
            if seq.grammar is not None:
                seq.grammar.observe(seq.token_ids, token)
        want = [r for r, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if want:
            rows = torch.tensor(want, device=self.device)
            k = max(seqs[r].sampling.logprobs for r in want)
            entries = iter(logprobs_of(logits[rows], tokens[rows], k))
            out.logprobs = [next(entries) if s.sampling.logprobs is not None else None for s in seqs]
        offset = 0
        for seq, start, count in inputs["prompt_rows"]:
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + count], device=self.device)
            entries = logprobs_of(prompt_logits[offset : offset + count], targets, seq.sampling.prompt_logprobs)
            out.prompt_logprobs.append(PromptLogprobChunk(seq, start + 1, entries))
            offset += count
        return out

    def _prepare(self, batch: ScheduledBatch) -> dict:
        bs = self.block_size
        ids, positions, logits_index, sampling_seqs = [], [], [], []
        slots: dict[int | None, list] = {w: [] for w in self.windows}
        prompt_index, prompt_rows = [], []  # rows whose logits score the next prompt token
        decode_rows, prefill_rows = [], []  # (seq, flat offset, start, n)
        offset = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            ids.append(seq.token_ids[start : start + n])
            positions.append(pos)
            for w, name in self.tables.items():
                table = np.asarray(getattr(seq, name))
                slots[w].append(table[pos // bs] * bs + pos % bs)
            (decode_rows if n == 1 else prefill_rows).append((seq, offset, start, n))
            if seq.scores_prompt and start < seq.num_prompt_tokens - 1:
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                prompt_index.extend(range(offset, offset + count))
                prompt_rows.append((seq, start, count))
            if batch.samples(i):
                logits_index.append(offset + n - 1)
                sampling_seqs.append(seq)
            offset += n
        dev = self.device
        groups = [self._group(rows, offset) for rows in (decode_rows, prefill_rows) if rows]
        meta = AttentionMetadata(
            slot_mapping={w: torch.from_numpy(np.concatenate(s)).to(dev) for w, s in slots.items()},
            groups=groups,
            num_tokens=offset,
        )
        return {
            "input_ids": torch.tensor([t for chunk in ids for t in chunk], dtype=torch.long, device=dev),
            "positions": torch.from_numpy(np.concatenate(positions)).to(dev),
            "meta": meta,
            "logits_index": torch.tensor(prompt_index + logits_index, dtype=torch.long, device=dev),
            "num_prompt_rows": len(prompt_index),
            "prompt_rows": prompt_rows,
            "sampling_seqs": sampling_seqs,
        }

    def _group(self, rows: list[tuple[Sequence, int, int, int]], num_tokens: int) -> AttentionGroup:
        bs = self.block_size
        b = len(rows)
        q_max = max(n for _, _, _, n in rows)
        starts = np.array([start for _, _, start, _ in rows])
        lens = np.array([n for _, _, _, n in rows])
        q_index = np.zeros((b, q_max), dtype=np.int64)
        out_index = np.full((b, q_max), num_tokens, dtype=np.int64)
        for r, (_, off, _, n) in enumerate(rows):
            q_index[r, :n] = out_index[r, :n] = np.arange(off, off + n)
        q_pos = starts[:, None] + np.arange(q_max)[None, :]  # [B, Q] absolute positions
        valid_q = np.arange(q_max)[None, :] < lens[:, None]
        last = -(-(starts + lens) // bs)  # one past each row's last block
        in_block = np.arange(bs)
        dev = self.device
        kv_slots, masks = {}, {}
        for w, name in self.tables.items():
            # a windowed view starts at the first block the window still reaches
            first = np.maximum(starts - w + 1, 0) // bs if w else np.zeros(b, dtype=np.int64)
            width = int((last - first).max()) * bs
            slot_rows = np.zeros((b, width), dtype=np.int64)
            for r, (seq, _, _, _) in enumerate(rows):
                table = np.asarray(getattr(seq, name)[first[r] : last[r]])
                slot_rows[r, : len(table) * bs] = (table[:, None] * bs + in_block).ravel()
            k_pos = first[:, None] * bs + np.arange(width)[None, :]  # [B, K]
            mask = k_pos[:, None, :] <= q_pos[:, :, None]  # causal
            if w:
                mask &= k_pos[:, None, :] > q_pos[:, :, None] - w
            mask &= valid_q[:, :, None]
            mask[:, :, 0] |= ~valid_q  # a pad query attends to one key, so softmax stays finite
            kv_slots[w] = torch.from_numpy(slot_rows).to(dev)
            masks[w] = torch.from_numpy(mask).unsqueeze(1).to(dev)
        return AttentionGroup(
            q_index=torch.from_numpy(q_index).to(dev),
            out_index=torch.from_numpy(out_index).to(dev),
            kv_slots=kv_slots,
            masks=masks,
        )
