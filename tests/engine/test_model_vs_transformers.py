"""Sluice's Llama-family model against transformers on the same tiny checkpoints."""
from __future__ import annotations

import pytest
import torch
import transformers

from sluice.app.builtin_models import write_llama_family
from tests.engine.helpers import assert_logits_match, generate, make_engine, seq

VARIANTS = {
    "qwen3-tied": dict(architecture="Qwen3ForCausalLM"),
    "qwen2-bias": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=False),
    "llama-llama3-rope": dict(architecture="LlamaForCausalLM", tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-yarn-rope": dict(architecture="LlamaForCausalLM", num_kv_heads=4, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(architecture="LlamaForCausalLM", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-window-12": dict(architecture="MistralForCausalLM", sliding_window=12),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), list(range(100, 171, 2)), [300] * 3]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_llama_family(path, **VARIANTS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunked prefill
def test_logits_match_through_prefill_and_decode(checkpoint, budget):
    path, hf = checkpoint
    runner, sched = make_engine(path, budget=budget, block_size=8)
    seqs = [seq(f"r{i}", p, max_tokens=6, temperature=0.0) for i, p in enumerate(PROMPTS)]
    assert assert_logits_match(runner, sched, hf, seqs, tol=1e-4) == len(PROMPTS) * 6


def test_prompts_from_their_first_token_take_the_causal_fast_path(checkpoint):
    """The logits above matched through SDPA's is_causal for whole prompts (padded to the longest, within any
    sliding window), and through the explicit mask for a chunk whose keys begin before its queries."""
    path, _ = checkpoint
    runner, sched = make_engine(path, block_size=8)
    for i, p in enumerate(PROMPTS):
        sched.add(seq(f"r{i}", p, max_tokens=1, temperature=0.0))
    (group,) = runner._prepare(sched.schedule()).meta.groups
    assert group.causal == {w: w is None or w >= 37 for w in runner.windows}  # the longest prompt: 37
    runner, sched = make_engine(path, budget=16, block_size=8)
    for i, p in enumerate(PROMPTS):
        sched.add(seq(f"r{i}", p, max_tokens=1, temperature=0.0))
    batch = sched.schedule()  # r0 whole, r1's first 11 tokens
    logits, _ = runner.forward(batch)
    sched.update(batch, logits.argmax(-1).tolist())
    (group,) = runner._prepare(sched.schedule()).meta.groups  # r1 from position 11
    assert not any(group.causal.values())


def test_greedy_equals_transformers_generate(checkpoint):
    path, hf = checkpoint
    runner, sched = make_engine(path, block_size=16)
    out = generate(runner, sched, [seq(f"r{i}", p, max_tokens=12, temperature=0.0) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[f"r{i}"] == ref[0, len(p):].tolist()


def test_a_prefix_cached_prompt_gives_the_same_logits(checkpoint):
    path, hf = checkpoint
    runner, sched = make_engine(path, block_size=8)
    prompt = PROMPTS[2]  # 36 tokens: 4 full blocks can be reused
    generate(runner, sched, [seq("first", prompt, max_tokens=1, temperature=0.0)])
    second = seq("second", prompt, max_tokens=1, temperature=0.0)
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 32 and batch.num_new_tokens == [4]
    logits, _ = runner.forward(batch)
    torch.testing.assert_close(logits[0], _hf_last_logits(hf, prompt), rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_match_transformers_through_chunks(checkpoint):
    path, hf = checkpoint
    runner, sched = make_engine(path, budget=16, block_size=8)
    prompt = PROMPTS[1]
    sched.add(seq("p", prompt, max_tokens=1, prompt_logprobs=2))
    chunks = []
    while (batch := sched.schedule()) is not None:
        samples = runner.run(batch)
        chunks += samples.prompt_logprobs
        sched.update(batch, samples.tokens)
    assert [c.start for c in chunks] == [1, 17, 33]  # positions 0-15 score tokens 1-16, ...
    got = [e.logprob for c in chunks for e in c.entries]
    with torch.no_grad():
        lp = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    want = lp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)
    top = [e.top_ids for c in chunks for e in c.entries]
    assert top == lp.topk(2, dim=-1).indices.tolist()


def test_sliding_window_frees_blocks_that_fall_out_of_it(tmp_path):
    path = write_llama_family(tmp_path / "m", architecture="MistralForCausalLM", sliding_window=12)
    runner, sched = make_engine(path, block_size=4, budget=8)
    s = seq("long", list(range(5, 45)), max_tokens=60, temperature=0.0)
    sched.add(s)
    peak = 0
    while (batch := sched.schedule()) is not None:
        peak = max(peak, sched.bm.num_used)
        sched.update(batch, runner.run(batch).tokens)
    # 100 tokens would need 25 blocks; the window (12) plus a chunk (8) needs at most 7 at any time.
    assert peak <= 7 and sched.bm.num_free == sched.bm.num_blocks
