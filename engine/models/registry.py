"""Maps a checkpoint's `architectures[0]` to the model class that runs it."""
from __future__ import annotations

from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM

MODELS = {
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(hf_config: dict):
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in MODELS:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    return MODELS[arch]
