"""Mixtures of experts (engine/moe.py, engine/models/mixtures.py) against transformers on tiny checkpoints that
transformers writes: Qwen3-MoE, Qwen2-MoE (a shared expert) and Mixtral (a sliding window)."""
from __future__ import annotations

import pytest
import torch
import transformers

from sluice.engine.cpu.backend import CpuBackend
from sluice.engine.cpu.experts import F32Experts
from sluice.engine.cpu.matmul import F32Matmul
from sluice.engine.loader import load_model
from sluice.engine.models.mixtures import MoeConfig
from sluice.engine.moe import SparseMoE, mix, route
from tests.engine.helpers import assert_logits_match, generate, make_engine, seq

TINY: dict = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512)
FAMILIES: dict[str, tuple[str, dict]] = {
    # a dense layer between two mixtures; the top-2 weights renormalised
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, intermediate_size=96, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    # a shared expert; the top-2 weights as the softmax gives them; tied embeddings
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_hidden_layers=2, intermediate_size=96, num_experts=6,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         tie_word_embeddings=True)),
    # every layer a mixture, every layer's attention a window
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=16)),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), list(range(100, 171, 2)), [200] * 3]


def write_checkpoint(path, family: str, seed: int = 0):
    """A transformers model of the family at tiny size, its weights drawn at scales that make routing and
    logits decisive (transformers' own init gives near-uniform ones), saved as transformers saves it."""
    config_name, kw = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **kw)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:  # the routers' 3x: their logits spread, so near ties between experts are rare
                p.copy_(noise / p.shape[-1] ** 0.5 * (3.0 if name.endswith(".gate.weight") else 1.0))
    hf.save_pretrained(path)
    return hf.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_checkpoint(path, request.param)


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunked prefill
def test_logits_match_through_prefill_and_decode(checkpoint, budget):
    path, hf = checkpoint
    runner, sched = make_engine(path, budget=budget, block_size=8)
    seqs = [seq(f"r{i}", p, max_tokens=5, temperature=0.0) for i, p in enumerate(PROMPTS)]
    assert assert_logits_match(runner, sched, hf, seqs, tol=1e-4) == len(PROMPTS) * 5


def test_greedy_tokens_batched_and_preempted_equal_alone_and_transformers(checkpoint):
    path, hf = checkpoint
    runner, sched = make_engine(path, block_size=4, num_blocks=14)  # 56 slots: the four cannot all stay
    batched = generate(runner, sched, [seq(f"r{i}", p, max_tokens=10, temperature=0.0)
                                       for i, p in enumerate(PROMPTS)])
    assert sched.stats.num_preemptions > 0 or runner.sliding_window  # (a windowed sequence stops growing)
    for i, p in enumerate(PROMPTS):
        runner, sched = make_engine(path, block_size=4)
        alone = generate(runner, sched, [seq("a", p, max_tokens=10, temperature=0.0)])["a"]
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert batched[f"r{i}"] == alone == ref[0, len(p):].tolist()


def test_a_prefix_cached_prompt_gives_the_same_logits(checkpoint):
    path, hf = checkpoint
    runner, sched = make_engine(path, block_size=8)
    prompt = PROMPTS[2]
    generate(runner, sched, [seq("first", prompt, max_tokens=1, temperature=0.0)])
    second = seq("second", prompt, max_tokens=1, temperature=0.0)
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 32
    logits, _ = runner.forward(batch)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)


def test_mixture_layers_run_op_by_op_their_experts_on_the_kernels(checkpoint):
    path, _ = checkpoint
    runner, _ = make_engine(path)
    assert not runner.one_call and runner.model.model.stack is None
    mixtures = [layer.mlp for layer in runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert mixtures
    kernels = F32Matmul.build(torch.zeros(1, 2)) is not None
    assert all(isinstance(m.experts.run_expert, F32Experts) == kernels for m in mixtures)


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (1, [0, 3]), (2, [1])])
def test_the_layers_that_are_mixtures_are_those_transformers_builds(step, dense):
    config = transformers.Qwen2MoeConfig(**TINY, num_hidden_layers=4, intermediate_size=96, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=step, mlp_only_layers=dense)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    want = tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    assert MoeConfig.from_hf({**config.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}).sparse_layers == want


def test_mix_computes_each_chosen_expert_once_on_its_rows_and_no_other():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    chosen = torch.tensor([[3, 1], [1, 3], [6, 1], [3, 6], [1, 0]])
    weights = torch.rand(5, 2, generator=gen)
    scale = torch.randn(8, 8, 8, generator=gen)  # expert e: rows @ scale[e]
    calls: dict[int, list[int]] = {}

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        calls[e] = calls.get(e, []) + [len(rows)]
        return rows @ scale[e]

    out = mix(x, chosen, weights, expert)
    assert calls == {0: [1], 1: [4], 3: [3], 6: [2]}
    want = torch.stack([sum(w * (x[t] @ scale[e]) for e, w in zip(chosen[t].tolist(), weights[t])) for t in range(5)])
    torch.testing.assert_close(out, want)
    alone = torch.cat([mix(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], expert) for t in range(5)])
    assert torch.equal(alone, out)  # a row's sum does not depend on its neighbours


def test_renormalised_routing_is_a_softmax_over_the_chosen_logits():
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    weights, chosen = route(logits, 4, renormalize=True)
    torch.testing.assert_close(weights, logits.gather(1, chosen).softmax(-1))
    raw, same = route(logits, 4, renormalize=False)
    assert torch.equal(same, chosen) and (raw.sum(-1) < 1).all()


@pytest.mark.parametrize("bf16_values", [False, True])
def test_the_cpu_kernels_run_the_chosen_experts_as_torch_does(bf16_values):
    gen = torch.Generator().manual_seed(2)
    moe = SparseMoE(64, 8, 64, 2, renormalize=True, shared_intermediate_size=32)  # 2I = 128: SwiGLU fused
    with torch.no_grad():
        for p in moe.parameters():
            w = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(w.bfloat16().float() if bf16_values else w)
    x = torch.randn(9, 64, generator=gen)
    with torch.no_grad():
        want = moe(x)
        CpuBackend(torch.float32).prepare(moe, [])
        got = moe(x)
        alone = torch.cat([moe(x[t:t + 1]) for t in range(len(x))])
    if F32Matmul.build(torch.zeros(1, 2)) is None:  # (no AVX2 here: torch's path)
        assert moe.experts.run_expert is None
        return
    assert isinstance(moe.experts.run_expert, F32Experts)
    assert moe.experts.gate_up_proj.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone, got)


def test_experts_load_from_one_tensor_per_expert_or_transformers_fused_layout(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = write_checkpoint(tmp_path / "split", "qwen3-moe")
    model = load_model(tmp_path / "split", torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, hf.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(experts.down_proj, hf.model.layers[0].mlp.experts.down_proj)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(fused / "model.safetensors")))
    again = load_model(fused, torch.float32, torch.device("cpu"))
    assert torch.equal(again.model.layers[2].mlp.experts.down_proj, model.model.layers[2].mlp.experts.down_proj)
