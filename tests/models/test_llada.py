"""LLaDA specifics: config renaming, float32 RoPE, config variants, unsupported layouts."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import llada_config, random_state, write_checkpoint
from torch_reference import llada_logits
from transformers import AutoModelForCausalLM

from hf_blockdiff.model_patches.llada import LLaDAConfig, apply_rope_fp32, llada_rope


def test_default_config_is_llada_8b_under_standard_names():
    config = LLaDAConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
        4096, 32, 32, 32, 12288, 126464, False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.02


def test_rope_is_applied_in_float32():
    states = torch.randn(1, 2, 40, 16).to(torch.bfloat16)
    cos, sin = llada_rope(LLaDAConfig(d_model=32, n_heads=2), torch.arange(1000, 1040)[None])
    exact = apply_rope_fp32(states.float(), cos, sin)
    assert torch.equal(apply_rope_fp32(states, cos, sin), exact.to(torch.bfloat16))
    first, second = states.chunk(2, dim=-1)
    in_bf16 = states * cos.to(torch.bfloat16) + torch.cat((-second, first), -1) * sin.to(torch.bfloat16)
    assert not torch.equal(in_bf16, exact.to(torch.bfloat16))  # what applying it in bf16 (as Llama does) gives


@pytest.mark.parametrize("variant", [{"weight_tying": True}, {"include_bias": True}, {"include_qkv_bias": True}])
def test_released_config_variants(variant, tmp_path):
    """The tied head (input embedding as LM head) and the bias options of the released config keys."""
    config = llada_config(**variant)
    state = random_state(config)
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, state), dtype=torch.float32)
    ids = torch.randint(0, 90, (1, 7))
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, llada_logits(state, config, ids, torch.ones(1, 7, 7, dtype=torch.bool)),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option, message", [({"block_type": "sequential"}, "block_type"),
                                             ({"rope_full_precision": False}, "rope_full_precision"),
                                             ({"include_bias": True, "bias_for_layer_norm": None}, "layer-norm")])
def test_unsupported_layouts_are_refused(option, message):
    with pytest.raises(ValueError, match=message):
        LLaDAConfig(**option)


def test_labels_give_the_stock_causal_lm_loss(tmp_path):
    config = llada_config()
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, random_state(config)))
    ids = torch.randint(0, 90, (2, 7))
    with torch.no_grad():
        output = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(output.loss, expected)
