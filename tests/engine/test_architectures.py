"""The decoder families beyond Llama (Gemma 2 and 3, Phi-3, OLMo 2, Granite, SmolLM3, GLM-4, DeepSeek-V2 and V3) against
transformers, on tiny random checkpoints that transformers itself writes, run on the default CPU backend."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from sluice.app.builtin_models import write_llama_family
from sluice.engine.cpu import kernels
from sluice.engine.cpu.backend import decode_layer
from sluice.engine.layers import GeGLU, OffsetRMSNorm
from sluice.engine.loader import empty_model, load_model
from sluice.engine.model_runner import kv_block_bytes
from sluice.engine.models.registry import MODELS, model_class
from sluice.engine.moe import SparseMoE, route
from sluice.engine.rope import Rotary
from tests.engine.helpers import generate, make_engine, seq

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)

# name -> (transformers config class, its arguments beyond TINY, whether the layers may run in one C call)
# Kimi-K2-Instruct's config.json, less its tokenizer's and quantization's keys
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False}

VARIANTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    tie_word_embeddings=True), False),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                     "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 100000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1000.0}}), False),
    # Phi-4-mini's shape: LongRoPE on three quarters of each head, its original length 8: the short factors for
    # a sequence while it is at most 8 long, the long ones for every token a forward computes past that (the
    # 5-token prompt crosses it while decoding, the 3-token one on its last token, the others from the start)
    "phi3-longrope": ("Phi3Config", dict(original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}), False),
    "olmo2": ("Olmo2Config", dict(), False),
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.3,
                                      logits_scaling=4.0, tie_word_embeddings=True), False),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0, 1, 0]), True),
    "glm4": ("Glm4Config", dict(head_dim=16), False),
    # multi-head latent attention, the cache holding the latent and the rotary key (48 and 40 values a token:
    # the CPU kernels' attention, and torch's); mixtures after the first dense layer, with shared experts
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=40, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        moe_intermediate_size=24, first_k_dense_replace=1), False),
    "deepseek-v2": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=24, first_k_dense_replace=2, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8}), False),
    # V3's router: sigmoid scores, a score-correction bias (random here: write_checkpoint) for the choice, the
    # best 2 of 4 groups by their top-2 sums, the weights renormalised and scaled; YaRN as V3 ships it
    "deepseek-v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=40, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=24, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0}), False),
}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), list(range(100, 171, 2)), [200] * 3]


def write_checkpoint(path, config_class: str, **overrides) -> None:
    """A transformers model of that config at TINY size, its weights random (norm scales near 1, projections
    wide enough that the logits differ from row to row), saved as its checkpoint."""
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (a buffer to transformers, zero unless trained)
                b.normal_(0.0, 0.2)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (its checkpoint's path, transformers' model of it, whether its layers may run in one call),
    each written once, when first asked for."""
    written: dict = {}

    def get(name: str):
        if name not in written:
            config_class, overrides, one_call = VARIANTS[name]
            path = tmp_path_factory.mktemp(name)
            write_checkpoint(path, config_class, **overrides)
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
            written[name] = path, hf, one_call
        return written[name]

    return get


@pytest.fixture(params=sorted(VARIANTS))
def checkpoint(request, checkpoints):
    return checkpoints(request.param)


def transformers_logits(hf, tokens: list[int], forwards: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """transformers' logits [L, V] of a sequence: one causal forward, which scores each of its prefixes; or,
    `forwards` given ((first position, tokens) each), those forwards in turn over its cache, as generation runs
    them (LongRoPE chooses its factors per forward, by the sequence's length at its end)."""
    with torch.no_grad():
        if forwards is None:
            return hf(torch.tensor([tokens])).logits[0].float()
        cache = transformers.DynamicCache(config=hf.config)
        return torch.cat([hf(torch.tensor([tokens[a : a + n]]), cache=cache, use_cache=True,
                             position_ids=torch.arange(a, a + n).unsqueeze(0)).logits[0] for a, n in forwards]).float()


# each in one prefill step, or chunked prefill (V2-Lite's chunks take the kernels' latent attention as V3's do)
@pytest.mark.parametrize(("name", "budget"), [(name, budget) for name in sorted(VARIANTS) for budget in (2048, 16)
                                              if (name, budget) != ("deepseek-v2-lite", 16)])
def test_logits_match_through_prefill_and_decode(checkpoints, name, budget):
    """Every row the engine scores, against transformers' logits at that position of the whole sequence; for
    LongRoPE, of transformers computing the sequence in the same forwards as the engine's steps."""
    path, hf, _ = checkpoints(name)
    runner, sched = make_engine(path, budget=budget, block_size=8)
    seqs = [seq(f"r{i}", p, max_tokens=6, temperature=0.0) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        sched.add(s)
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {s.request_id: [] for s in seqs}
    forwards: dict[str, list[tuple[int, int]]] = {s.request_id: [] for s in seqs}
    while (batch := sched.schedule()) is not None:
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            forwards[s.request_id].append((s.num_computed_tokens, n))
        logits, sampling = runner.forward(batch)
        for row, s in enumerate(sampling):
            rows[s.request_id].append((len(s.token_ids) - 1, logits[row]))
        sched.update(batch, logits.argmax(-1).tolist())
    by_forward = hf.config.rope_parameters.get("rope_type") == "longrope"
    for s in seqs:
        ref = transformers_logits(hf, s.token_ids, forwards[s.request_id] if by_forward else None)  # [L, V]
        assert [p for p, _ in rows[s.request_id]] == list(range(s.num_prompt_tokens - 1, len(s.token_ids) - 1))
        for position, got in rows[s.request_id]:
            torch.testing.assert_close(got, ref[position], rtol=1e-4, atol=1e-4)


# (V2-Lite's cache and attention path, a 48-wide latent through the kernels, is V3's: its logits above suffice)
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"deepseek-v2-lite"}))
def test_greedy_tokens_batched_and_preempted_equal_alone_and_prefix_cached(checkpoints, name):
    path, _, _ = checkpoints(name)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    runner, sched = make_engine(path, block_size=4, num_blocks=14)  # 56 slots: the four cannot all stay
    batched = generate(runner, sched, [seq(r, p, max_tokens=10, temperature=0.0) for r, p in prompts.items()])
    assert sched.stats.num_preemptions > 0
    runner, sched = make_engine(path, block_size=4)
    for r, p in prompts.items():
        assert generate(runner, sched, [seq(r, p, max_tokens=10, temperature=0.0)]) == {r: batched[r]}
    again = seq("again", PROMPTS[1], max_tokens=10, temperature=0.0)
    assert generate(runner, sched, [again]) == {"again": batched["r1"]}
    assert again.num_cached_tokens == 36  # the 37-token prompt's 9 whole blocks


def test_only_layers_the_kernels_compute_run_in_one_call(checkpoint):
    """The CPU backend runs a step's layers in one C call only for plain Llama-family layers; a family with
    behaviour of its own (sandwich norms, soft-capping, GeGLU, windows per layer, ...) runs op by op (the
    logits above are the proof that it computes that behaviour)."""
    path, _, one_call = checkpoint
    runner, _ = make_engine(path, block_size=8)
    assert runner.one_call == (one_call and kernels.f32_step() is not None)  # (the kernel needs AVX-512F or AVX2)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v2", "deepseek-v3"])
def test_the_latent_cache_holds_one_latent_and_rotary_key_per_token_per_layer(checkpoints, name):
    """Multi-head latent attention's cache: kv_lora_rank + qk_rope_head_dim values a token a layer, in one
    tensor that is both the keys and the values, not the heads' expanded keys and values (here 4 heads of
    24 + 12: 144 values, against 48 or 40)."""
    path, hf, _ = checkpoints(name)
    c = hf.config
    runner, _ = make_engine(path, block_size=8, num_blocks=16)
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    assert kv_block_bytes(runner.model, 8, torch.float32) == c.num_hidden_layers * 8 * latent * 4
    assert all(k is v and k.shape == (16 * 8, 1, latent) for k, v in runner.kv_caches)
    held = {k.untyped_storage().data_ptr(): k.untyped_storage().nbytes() for pair in runner.kv_caches for k in pair}
    assert sum(held.values()) == 16 * kv_block_bytes(runner.model, 8, torch.float32)


def test_group_limited_routing_chooses_only_among_the_best_groups():
    """DeepSeek's group-limited greedy: with the experts in 4 groups of 2 and 2 groups kept, a token whose best
    experts lie in one group takes its top 3 from the two groups whose best expert scores highest, weighted
    by their softmax probabilities times the routed scale."""
    logits = torch.tensor([[5.0, 1.0, 4.9, 0.0, 4.8, 4.7, 0.0, 0.0]])  # groups (0 1) (2 3) (4 5) (6 7)
    probs = logits.softmax(-1)
    assert route(logits, 3, renormalize=False)[1].tolist() == [[0, 2, 4]]  # (ungrouped: a third group's)
    weights, chosen = route(logits, 3, renormalize=False, groups=(4, 2), scale=1.5)
    assert chosen.tolist() == [[0, 2, 1]]
    torch.testing.assert_close(weights, probs[:, [0, 2, 1]] * 1.5)


def test_v3_routing_chooses_by_corrected_sigmoid_scores_among_the_groups_whose_best_two_sum_highest():
    """DeepSeek-V3's noaux_tc: sigmoid scores plus the correction bias choose, among the 2 of 4 groups whose two
    best corrected scores sum highest; the chosen get their uncorrected scores, renormalised and scaled."""
    logits = torch.tensor([[3.0, -3.0, 1.0, 0.9, 2.0, -3.0, 0.0, 0.0]])  # groups (0 1) (2 3) (4 5) (6 7)
    bias = torch.tensor([0.0] * 7 + [0.5])  # expert 7: 0.5 + 0.5

    def chosen(**kw) -> list[int]:
        return sorted(route(logits, 3, renormalize=True, sigmoid=True, **kw)[1][0].tolist())

    assert chosen() == [0, 2, 4]
    assert chosen(correction=bias) == [0, 4, 7]
    # the groups by their best two: (6 7) 1.5, (2 3) 1.44, (0 1) 1.0, (4 5) 0.93; by their best one, (6 7) and
    # (0 1) would be kept, and 0 and 6 chosen with 7
    assert chosen(correction=bias, groups=(4, 2)) == [2, 3, 7]
    weights, experts = route(logits, 3, renormalize=True, groups=(4, 2), scale=2.5, sigmoid=True, correction=bias)
    scores = logits.sigmoid()[0, experts[0]]
    torch.testing.assert_close(weights[0], scores / scores.sum() * 2.5)


def test_the_v3_checkpoints_experts_depend_on_the_correction_and_the_groups(checkpoints):
    """In the tiny V3 checkpoint both change the experts tokens choose: its mixture equals transformers' with
    both, and neither without one (so the logits test above fails where the engine ignores either)."""
    path, hf, _ = checkpoints("deepseek-v3")
    moe = load_model(path, torch.float32, torch.device("cpu")).model.layers[1].mlp
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))  # [T, D], as the norm before it gives
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x.unsqueeze(0))[0]
        torch.testing.assert_close(moe(x), ref, rtol=1e-4, atol=1e-4)
        chosen = moe_choices(moe, x)
        bias, moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias, None
        assert moe_choices(moe, x) != chosen and not torch.allclose(moe(x), ref, rtol=1e-3, atol=1e-3)
        moe.gate.e_score_correction_bias, moe.groups = bias, None
        assert moe_choices(moe, x) != chosen and not torch.allclose(moe(x), ref, rtol=1e-3, atol=1e-3)


def moe_choices(moe: SparseMoE, x: torch.Tensor) -> list[set[int]]:
    return [set(row) for row in moe.choose(x)[1].tolist()]


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_yarn_tables_and_the_mscale_score_scale_equal_transformers(checkpoints, name):
    """YaRN as DeepSeek configures it: the rotary tables scaled by mscale / mscale_all_dim's ratio (0.8 in the
    V2 checkpoint: not 1) and the scores by mscale_all_dim's temperature squared, as transformers' are."""
    path, hf, _ = checkpoints(name)
    model = empty_model(json.loads((path / "config.json").read_text()), torch.float32, torch.device("cpu"))
    attn = hf.model.layers[0].self_attn
    assert model.model.layers[0].self_attn.scale == pytest.approx(attn.scaling, rel=1e-12)
    assert attn.scaling != pytest.approx(attn.qk_head_dim ** -0.5)
    positions = torch.arange(256).unsqueeze(0)
    half = hf.config.qk_rope_head_dim // 2
    if name == "deepseek-v2":  # (cos + i sin, times the ratio)
        table = hf.model.rotary_emb(torch.zeros(1), positions)[0]
        cos, sin = table.real, table.imag
    else:  # (the halves repeated)
        cos, sin = (t[0, :, :half] for t in hf.model.rotary_emb(torch.zeros(1), positions))
    torch.testing.assert_close(model.rotary.cos, cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.rotary.sin, sin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleave", [True, False])
def test_v3_rotary_gives_transformers_scores_with_or_without_rope_interleave(checkpoints, interleave):
    """V3's `rope_interleave` (pairs 2i / 2i + 1, its default) or not (i / i + rope/2): the rotated queries'
    and keys' dot products at every pair of positions are transformers' (its interleaved form returns the
    dimensions permuted, the same for queries and keys)."""
    path, hf, _ = checkpoints("deepseek-v3")
    config = {**json.loads((path / "config.json").read_text()), "rope_interleave": interleave}
    rotary = empty_model(config, torch.float32, torch.device("cpu")).rotary
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)  # [T, H, rope]
    positions = torch.arange(40)
    ours = torch.einsum("thd,shd->hts", rotary(q, positions), rotary(k, positions))
    cos, sin = hf.model.rotary_emb(torch.zeros(1), positions.unsqueeze(0))
    v3 = transformers.models.deepseek_v3.modeling_deepseek_v3
    rotate = v3.apply_rotary_pos_emb_interleave if interleave else v3.apply_rotary_pos_emb
    hq, hk = rotate(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)  # [1, H, T, rope]
    torch.testing.assert_close(ours, hq[0] @ hk[0].transpose(1, 2), rtol=1e-4, atol=1e-4)


def test_a_bf16_v3_keeps_the_routers_correction_bias_in_float32(checkpoints):
    """As transformers and vLLM do: the bias tells apart experts whose sigmoid scores differ by less than bf16
    resolves near 1."""
    path, hf, _ = checkpoints("deepseek-v3")
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)


def test_deepseek_v3s_multi_token_prediction_layers_are_skipped_at_load_with_a_log_line(checkpoints, tmp_path,
                                                                                        caplog):
    """V3 and R1 checkpoints hold `num_nextn_predict_layers` more layers after the last (model.layers.61 of
    61): the model loads without them, saying so; a checkpoint whose config declares none is still refused."""
    path, _, _ = checkpoints("deepseek-v3")
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)},
              tmp_path / "m" / "mtp.safetensors")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="tensors the model does not use"):
        load_model(tmp_path / "m", torch.float32, torch.device("cpu"))
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        load_model(tmp_path / "m", torch.float32, torch.device("cpu"))
    assert "skipping the 2 tensors of 1 multi-token prediction layer(s) (model.layers.3...)" in caplog.text


def test_kimi_k2s_config_is_deepseek_v3s_with_one_group():
    """Kimi-K2 (model_type kimi_k2) names DeepseekV3ForCausalLM: 384 experts in one group (every token
    choosing among all), sigmoid scores with the correction, renormalised, times 2.827; one dense layer;
    YaRN x32 as `type` (the classic key) with its mscale in the scores."""
    c = model_class(KIMI_K2).config_class.from_hf(KIMI_K2)
    assert (c.num_experts, c.experts_per_token, c.groups, c.sigmoid, c.corrected, c.renormalize) == \
        (384, 8, None, True, True, True)
    assert c.routed_scale == 2.827 and c.sparse_layers == (False,) + (True,) * 60 and c.mtp_layers == 0
    assert c.rope_scaling["rope_type"] == "yarn"
    assert c.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2)
    with torch.device("meta"):  # (two of its layers: the dense one and a mixture)
        model = model_class(KIMI_K2)(dataclasses.replace(c, num_layers=2, sparse_layers=(False, True)))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.shape == (384,)


def test_an_unknown_architecture_is_refused_with_the_served_ones():
    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported") as e:
        model_class({"architectures": ["FalconForCausalLM"]})
    assert all(name in str(e.value) for name in MODELS)


def test_longrope_tables_hold_the_short_factors_then_the_long_ones_as_transformers_computes_them():
    """A Phi-3 config's rotary table: the short factors' rows (transformers' for a sequence at most the
    original 64 long), then the long factors' (transformers' for a longer one)."""
    config = transformers.Phi3Config(**TINY, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})
    c = model_class({"architectures": ["Phi3ForCausalLM"]}).config_class.from_hf(
        {**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rotary = Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling)
    assert rotary.rotary_dim == 12 and rotary.cos.shape == (2 * 256, 6)
    for rows, length in ((slice(0, 64), 64), (slice(256, 512), 256)):
        hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)  # (it keeps the last choice)
        cos, sin = hf(torch.zeros(1), torch.arange(length).unsqueeze(0))  # [1, P, R] (halves repeated)
        torch.testing.assert_close(rotary.cos[rows], cos[0, :, :6], rtol=1e-4, atol=1e-4)  # (float32 angles)
        torch.testing.assert_close(rotary.sin[rows], sin[0, :, :6], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(rotary.cos[:64], rotary.cos[256:320])


@pytest.mark.parametrize("change", ["softcap", "offset_norm", "geglu", "partial_rotary", "whole_qk_norm"])
def test_the_one_call_stack_refuses_a_llama_layer_given_behaviour_it_does_not_compute(tmp_path, change):
    """A plain Qwen3 layer runs in one call; the same layer given any one option of the families above does
    not (each is an option or subclass of the same classes, so the check is on exact classes and options)."""
    if kernels.f32_layers() is None:
        pytest.skip("the float32 layers kernel needs AVX-512F")
    runner, _ = make_engine(write_llama_family(tmp_path / "m", architecture="Qwen3ForCausalLM"))
    layer, kv = runner.model.model.layers[0], runner.kv_caches[0]
    assert decode_layer(layer, kv) is not None
    attn = layer.self_attn
    if change == "softcap":
        attn.softcap = 50.0
    elif change == "offset_norm":
        layer.post_attention_layernorm.__class__ = OffsetRMSNorm
    elif change == "geglu":
        layer.mlp.__class__ = GeGLU
    elif change == "partial_rotary":
        attn.rotary = Rotary(16, 64, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5})
    else:
        attn.qk_norm_per_head = False
    assert decode_layer(layer, kv) is None
