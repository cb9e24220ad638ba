"""The dense decoder families beyond Llama (Gemma 2 and 3, Phi-3, OLMo 2, Granite, SmolLM3, GLM-4) against
transformers, on tiny random checkpoints that transformers itself writes, run on the default CPU backend."""
from __future__ import annotations

import pytest
import torch
import transformers

from sluice.app.builtin_models import write_llama_family
from sluice.engine.cpu import kernels
from sluice.engine.cpu.backend import decode_layer
from sluice.engine.layers import GeGLU, OffsetRMSNorm
from sluice.engine.models.registry import MODELS, model_class
from sluice.engine.rope import Rotary
from tests.engine.helpers import generate, make_engine, seq

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)

# name -> (transformers config class, its arguments beyond TINY, whether the layers may run in one C call)
VARIANTS = {
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
    # Phi-4-mini's shape: LongRoPE on three quarters of each head (past the original 8 positions: the long
    # factors, which transformers applies to every position of a sequence that long)
    "phi3-longrope": ("Phi3Config", dict(original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}), False),
    "olmo2": ("Olmo2Config", dict(), False),
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.3,
                                      logits_scaling=4.0, tie_word_embeddings=True), False),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0, 1, 0]), True),
    "glm4": ("Glm4Config", dict(head_dim=16), False),
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


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunked prefill
def test_logits_match_through_prefill_and_decode(checkpoint, budget):
    """Every row the engine scores, against transformers' logits at that position of the whole sequence (one
    causal forward per sequence scores each of its prefixes)."""
    path, hf, _ = checkpoint
    runner, sched = make_engine(path, budget=budget, block_size=8)
    seqs = [seq(f"r{i}", p, max_tokens=6, temperature=0.0) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        sched.add(s)
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {s.request_id: [] for s in seqs}
    while (batch := sched.schedule()) is not None:
        logits, sampling = runner.forward(batch)
        for row, s in enumerate(sampling):
            rows[s.request_id].append((len(s.token_ids) - 1, logits[row]))
        sched.update(batch, logits.argmax(-1).tolist())
    for s in seqs:
        with torch.no_grad():
            ref = hf(torch.tensor([s.token_ids])).logits[0].float()  # [L, V]
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


def test_an_unknown_architecture_is_refused_with_the_served_ones():
    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported") as e:
        model_class({"architectures": ["FalconForCausalLM"]})
    assert all(name in str(e.value) for name in MODELS)


@pytest.mark.parametrize("max_positions", [256, 64])
def test_longrope_takes_the_long_factors_where_the_model_serves_past_the_original_length(max_positions):
    """The rotary table of a Phi-3 config serving 256 positions (past the original 64: the long factors), or
    64 (the short ones), as transformers computes it for a sequence of that length."""
    config = transformers.Phi3Config(**{**TINY, "max_position_embeddings": max_positions},
                                     original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})
    c = model_class({"architectures": ["Phi3ForCausalLM"]}).config_class.from_hf(
        {**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rotary = Rotary(c.head_dim, c.max_positions, c.rope_theta, c.rope_scaling)
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1), torch.arange(max_positions).unsqueeze(0))  # [1, P, R] (halves repeated)
    assert rotary.rotary_dim == 12
    torch.testing.assert_close(rotary.cos, cos[0, :, :6], rtol=1e-4, atol=1e-4)  # (transformers: float32 angles)
    torch.testing.assert_close(rotary.sin, sin[0, :, :6], rtol=1e-4, atol=1e-4)


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
