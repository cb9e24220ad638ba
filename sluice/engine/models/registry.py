"""Maps a checkpoint's `architectures[0]` to the model class that runs it."""
from __future__ import annotations

from sluice.engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from sluice.engine.models.gemma import GemmaForCausalLM
from sluice.engine.models.glm4 import Glm4ForCausalLM
from sluice.engine.models.gpt_oss import GptOssForCausalLM
from sluice.engine.models.granite import GraniteForCausalLM
from sluice.engine.models.llama import LlamaForCausalLM
from sluice.engine.models.mixtures import MoeForCausalLM
from sluice.engine.models.olmo2 import Olmo2ForCausalLM
from sluice.engine.models.smollm3 import SmolLM3ForCausalLM

MODELS = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,  # (V3, R1, Kimi-K2: V2's model, V3's routing)
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def model_class(hf_config: dict):
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in MODELS:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    return MODELS[arch]
