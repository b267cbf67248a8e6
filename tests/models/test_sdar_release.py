"""The real released SDAR files (config, weight index, tokenizer) load offline with our classes."""

from __future__ import annotations

import json

import torch
from released_checkpoints import SDAR_4B, SDAR_8B
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_blockdiff.model_patches import profile_for
from hf_blockdiff.model_patches.sdar import SDARConfig, SDARForCausalLM


def _meta_model(path):
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_released_config_builds_the_released_model():
    model = _meta_model(SDAR_4B)
    assert isinstance(model, SDARForCausalLM) and isinstance(model.config, SDARConfig)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 4.41  # Qwen3-4B, untied head
    assert round(sum(p.numel() for p in _meta_model(SDAR_8B).parameters()) / 1e9, 2) == 8.19  # Qwen3-8B, untied
    released_names = json.loads((SDAR_4B / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(model.state_dict()) == set(released_names)


def test_released_flex_attention_setting_is_not_forced():
    config = AutoConfig.from_pretrained(SDAR_4B)
    assert config._attn_implementation is None  # -> the transformers default (sdpa) when a model is built
    assert _meta_model(SDAR_4B).config._attn_implementation == "sdpa"
    assert AutoConfig.from_pretrained(SDAR_4B, attn_implementation="eager")._attn_implementation == "eager"
    assert config.to_dict()["attn_implementation"] == "flex_attention"  # written back on save
    profile = profile_for(config)
    assert (profile.mask_token_id, profile.block_size, profile.attention, profile.alignment, profile.logit_shift) == (
        151669, 4, "block_causal", "absolute", False)


def test_tokenizer_loads_offline_as_stock_qwen2_and_formats_chats():
    tokenizer = AutoTokenizer.from_pretrained(SDAR_4B)  # its auto_map names remote code: not needed, not used
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.mask_token == "<|MASK|>" and tokenizer.mask_token_id == 151669
    assert tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) == [151645, 151643]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids[0] == 151644 and tokenizer.decode(ids) == prompt
