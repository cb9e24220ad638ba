"""gpt-oss against transformers on the same tiny checkpoint, bf16 and MXFP4."""
from __future__ import annotations

import pytest
import torch
import transformers

from sluice.app.builtin_gpt_oss import write_gpt_oss
from sluice.engine.models.gpt_oss import dequantize_mxfp4
from tests.engine.helpers import assert_logits_match, generate, make_engine, seq

PROMPTS = [[200006, 1428, 200008, 13225], list(range(1000, 1030)), list(range(5000, 5050, 2)), [300] * 11]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    bf16 = write_gpt_oss(root / "bf16", mxfp4=False)
    mxfp4 = write_gpt_oss(root / "mxfp4", mxfp4=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
    return {"bf16": bf16, "mxfp4": mxfp4}, hf


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 140, (3, 8, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
@pytest.mark.parametrize("budget", [4096, 8])  # one prefill step, or chunks shorter than the window
def test_logits_match_transformers(checkpoints, layout, budget):
    paths, hf = checkpoints
    runner, sched = make_engine(paths[layout], budget=budget, block_size=4)
    seqs = [seq(f"r{i}", p, max_tokens=5, temperature=0.0) for i, p in enumerate(PROMPTS)]  # longer than the window
    assert assert_logits_match(runner, sched, hf, seqs, tol=2e-4) == len(PROMPTS) * 5


def test_greedy_equals_transformers_generate(checkpoints):
    paths, hf = checkpoints
    runner, sched = make_engine(paths["mxfp4"], block_size=4)
    out = generate(runner, sched, [seq(f"r{i}", p, max_tokens=10, temperature=0.0) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[f"r{i}"] == ref[0, len(p):].tolist()


def test_sliding_layers_free_what_falls_out_of_their_window(checkpoints):
    paths, hf = checkpoints
    runner, sched = make_engine(paths["mxfp4"], block_size=4, budget=8)
    assert runner.hybrid and sched.window_pool is not None
    prompt = list(range(1000, 1040))
    s = seq("long", prompt, max_tokens=40, temperature=0.0)
    sched.add(s)
    out, peak_window, peak_full = [], 0, 0
    while (batch := sched.schedule()) is not None:
        peak_window = max(peak_window, sched.window_pool.num_used)
        peak_full = max(peak_full, sched.bm.num_used)
        out += [tok for _, tok in sched.update(batch, runner.run(batch).tokens).new_tokens]
    # 80 tokens: the full-attention layers hold all 20 blocks; the sliding layers (window 8) only the
    # blocks the window and one 8-token chunk reach
    assert peak_full == 20 and peak_window <= -(-(8 - 1 + 8) // 4) + 1
    assert sched.window_pool.num_free == sched.window_pool.num_blocks and sched.bm.num_free == sched.bm.num_blocks
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == ref[0, len(prompt):].tolist()


def test_prefix_caching_with_a_window_pool_gives_the_same_logits(checkpoints):
    paths, hf = checkpoints
    runner, sched = make_engine(paths["bf16"], block_size=4)
    prompt = list(range(2000, 2030))  # 30 tokens: 7 full blocks could be reused
    generate(runner, sched, [seq("first", prompt, max_tokens=1, temperature=0.0)])
    # the window pool freed the blocks before the window as the first prompt was computed, but they
    # stay cached: the whole prefix (and the window's tail of it) is found again
    again = seq("again", prompt + [7, 8], max_tokens=1, temperature=0.0)
    sched.add(again)
    batch = sched.schedule()
    assert again.num_cached_tokens == 28 and batch.num_new_tokens == [4]
    assert again.window_table[:5] == [-1] * 5 and min(again.window_table[5:]) >= 0  # window 8: blocks 5, 6
    logits, _ = runner.forward(batch)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [7, 8]])).logits[0, -1].float()
    torch.testing.assert_close(logits[0], ref, rtol=2e-4, atol=2e-4)
