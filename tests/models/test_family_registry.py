"""`register_all`: the Auto classes and profiles of every family, idempotently, and the MoE weight conversion."""

from __future__ import annotations

import torch
from released_checkpoints import random_state, sdar_moe_config, write_checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_blockdiff.model_patches import FAMILIES, register_all, registered_model_types
from hf_blockdiff.model_patches.dream import DreamConfig, DreamModel
from hf_blockdiff.model_patches.fast_dllm import Fast_dLLM_QwenConfig


def test_register_all_is_idempotent_and_covers_every_family():
    register_all()
    register_all()
    for config_class, model_class, causal_lm_class, _ in FAMILIES:
        config = AutoConfig.for_model(config_class.model_type)  # full-size defaults: build on the meta device
        assert type(config) is config_class
        with torch.device("meta"):
            assert type(AutoModel.from_config(config)) is model_class
            assert type(AutoModelForCausalLM.from_config(config)) is causal_lm_class
    assert set(registered_model_types()) >= {"sdar", "sdar_moe", "llada", "Dream", "Fast_dLLM_Qwen"}


def _tiny(config_class, **sizes):
    return config_class(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=32, **sizes)


def test_dream_auto_model_is_the_language_model_as_released():
    assert type(AutoModel.from_config(_tiny(DreamConfig, mask_token_id=31))) is DreamModel


def test_fast_dllm_block_size_is_bd_size():
    config = _tiny(Fast_dLLM_QwenConfig, bd_size=8)
    assert config.block_size == 8 and config.to_dict()["bd_size"] == 8 and "block_size" not in config.to_dict()


def test_sdar_moe_experts_are_fused_in_the_model_and_per_expert_on_disk(tmp_path):
    config = sdar_moe_config()
    state = random_state(config)
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, state), dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    per_expert = [torch.cat((state[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                             state[f"model.layers.0.mlp.experts.{e}.up_proj.weight"])) for e in range(4)]
    assert torch.equal(experts.gate_up_proj, torch.stack(per_expert))
    assert torch.equal(experts.down_proj[3], state["model.layers.0.mlp.experts.3.down_proj.weight"])
