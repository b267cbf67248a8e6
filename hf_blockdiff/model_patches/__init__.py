"""Model families: config/model classes for the released diffusion checkpoints and their decoding profiles.

`register_all()` makes `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` (and so `AutoTokenizer`, which resolves the
config first) load these checkpoints with our classes, never with the remote code their `auto_map` names.

The language-model classes carry the released class names (`SDARForCausalLM`, `SDARMoeForCausalLM`, `LLaDAModelLM`,
`DreamModel`, `Fast_dLLM_QwenForCausalLM`, `LLaDA2MoeModelLM`): `save_pretrained` records the class name in `architectures`, and serving
engines pick their implementation by it, so a saved checkpoint keeps the released value.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import dream, fast_dllm, llada, llada2, sdar, sdar_moe
from ..config.profiles import ModelProfile, profile_for, register_profile, registered_model_types

# (config, AutoModel class, AutoModelForCausalLM class, profile)
FAMILIES = (
    (sdar.SDARConfig, sdar.SDARModel, sdar.SDARForCausalLM, sdar.PROFILE),
    (sdar_moe.SDARMoeConfig, sdar_moe.SDARMoeModel, sdar_moe.SDARMoeForCausalLM, sdar.PROFILE),
    # released AutoModel of LLaDA and Dream: the LM (their generate scripts load it with AutoModel and read .logits)
    (llada.LLaDAConfig, llada.LLaDAModelLM, llada.LLaDAModelLM, llada.PROFILE),
    (dream.DreamConfig, dream.DreamModel, dream.DreamModel, dream.PROFILE),
    (fast_dllm.Fast_dLLM_QwenConfig, fast_dllm.Fast_dLLM_QwenModel, fast_dllm.Fast_dLLM_QwenForCausalLM,
     fast_dllm.PROFILE),
    (llada2.LLaDA2MoeConfig, llada2.LLaDA2MoeModel, llada2.LLaDA2MoeModelLM, llada2.PROFILE),
)


def register_all() -> None:
    """Register every family's classes with the transformers Auto classes and its decoding profile. Idempotent."""
    for config_class, model_class, causal_lm_class, profile in FAMILIES:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
        register_profile(config_class.model_type, profile)
    sdar_moe.register_expert_conversion()
    llada2.register_checkpoint_conversion()


__all__ = ["FAMILIES", "ModelProfile", "profile_for", "register_all", "register_profile", "registered_model_types"]
