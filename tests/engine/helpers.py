"""Engine pieces wired together without a process, for tests."""
from __future__ import annotations

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.loader import load_model
from sluice.engine.model_runner import ModelRunner
from sluice.engine.scheduler import Scheduler
from sluice.engine.sequence import Sequence
from sluice.ipc.messages import SamplingParams


def make_engine(path, *, num_blocks=256, block_size=16, budget=2048, max_num_seqs=64, max_model_len=4096,
                prefix_caching=True, dtype=torch.float32, kv_dtype=None):
    model = load_model(path, dtype, torch.device("cpu"))
    runner = ModelRunner(model, num_blocks, block_size, dtype, torch.device("cpu"), num_blocks, kv_dtype=kv_dtype)
    window_pool = BlockManager(num_blocks, block_size, prefix_caching, "window_table") if runner.hybrid else None
    sched = Scheduler(BlockManager(num_blocks, block_size, prefix_caching),
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                      sliding_window=runner.sliding_window, window_pool=window_pool)
    return runner, sched


def seq(rid: str, prompt: list[int], max_tokens: int = 8, seed: int = 0, priority: int = 0, **kw) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), seed=seed, priority=priority)


def generate(runner: ModelRunner, sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> dict:
    """Runs until every sequence finishes; returns request id -> output token ids."""
    for s in seqs:
        sched.add(s)
    out: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            break
        for s, tok in sched.update(batch, runner.run(batch).tokens).new_tokens:
            out[s.request_id].append(tok)
    assert len(sched) == 0, "sequences left unfinished"
    return out


def assert_logits_match(runner, sched, hf, seqs: list[Sequence], tol: float) -> int:
    """Steps the engine to the end, checking every sampled row's logits against transformers' full
    forward of the same tokens; returns how many rows were checked."""
    for s in seqs:
        sched.add(s)
    checked = 0
    while (batch := sched.schedule()) is not None:
        logits, sampling = runner.forward(batch)
        for row, s in enumerate(sampling):
            with torch.no_grad():
                ref = hf(torch.tensor([s.token_ids])).logits[0, -1].float()
            torch.testing.assert_close(logits[row], ref, rtol=tol, atol=tol)
            checked += 1
        sched.update(batch, logits.argmax(-1).tolist())
    return checked
