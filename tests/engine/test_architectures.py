"""The decoder families beyond Llama (Gemma 2 and 3, Phi-3, OLMo 2, Granite, SmolLM3, GLM-4, DeepSeek-V2) against
transformers, on tiny random checkpoints that transformers itself writes, run on the default CPU backend."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from sluice.app.builtin_models import write_llama_family
from sluice.engine.cpu import kernels
from sluice.engine.cpu.backend import decode_layer
from sluice.engine.layers import GeGLU, OffsetRMSNorm
from sluice.engine.model_runner import kv_block_bytes
from sluice.engine.models.registry import MODELS, model_class
from sluice.engine.moe import route
from sluice.engine.rope import Rotary
from tests.engine.helpers import generate, make_engine, seq

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)

# name -> (transformers config class, its arguments beyond TINY, whether the layers may run in one C call)
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


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunked prefill
def test_logits_match_through_prefill_and_decode(checkpoint, budget):
    """Every row the engine scores, against transformers' logits at that position of the whole sequence; for
    LongRoPE, of transformers computing the sequence in the same forwards as the engine's steps."""
    path, hf, _ = checkpoint
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


def test_greedy_tokens_batched_and_preempted_equal_alone_and_prefix_cached(checkpoint):
    path, _, _ = checkpoint
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


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v2"])
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
