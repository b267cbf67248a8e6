"""Each released family, loaded from a tiny checkpoint in its on-disk format, decodes with its own profile (no
mask id, block size, attention, alignment or shift passed) exactly as its reference loop."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import (dream_config, fast_dllm_config, llada_config, sdar_config, sharp_state,
                                  write_checkpoint)
from transformers import AutoModelForCausalLM

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.config.profiles import model_profile
from reference_loops import llada_reference, sdar_reference
from reference_presets import dream_reference, fast_dllm_v2_reference

MASK = 95
PROMPTS = [torch.tensor([5, 17, 33, 8, 61, 2, 40, 12]), torch.tensor([7, 3, 88, 21, 9])]


def load(tmp_path, name, config):
    directory = write_checkpoint(tmp_path / name, config, sharp_state(config))
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def decode(model, cfg, prompt):
    out = model.generate_multi_block(prompt[None], cfg, return_dict=True)
    return out.sequences[0, len(prompt):], out.num_forwards


def stops(model, cfg):
    resolved = cfg.resolved(model_profile(model), model.config.vocab_size)
    return tuple(resolved.stop_ids), resolved.pad_token_id, resolved


def test_sdar_family(tmp_path):
    model = load(tmp_path, "sdar", sdar_config())
    cfg = BlockDiffusionConfig.from_preset("sdar", max_new_tokens=12, threshold=0.5)
    stop_ids, pad, resolved = stops(model, cfg)
    assert (resolved.mask_token_id, resolved.block_size, resolved.alignment) == (MASK, 4, "absolute")
    for prompt in PROMPTS:
        expected = sdar_reference(model, prompt, MASK, 4, 4, 12, "low_confidence_dynamic", 0.5, stop_ids=stop_ids,
                                  pad=pad)
        assert decode(model, cfg, prompt)[0].tolist() == expected[0].tolist()


def test_llada_family(tmp_path):
    model = load(tmp_path, "llada", llada_config())
    cfg = BlockDiffusionConfig.from_preset("llada", max_new_tokens=8, steps_per_block=4, block_size=4)
    stop_ids, pad, resolved = stops(model, cfg)
    assert (resolved.attention, resolved.alignment, resolved.logit_shift) == ("bidirectional", "prompt_end", False)
    for prompt in PROMPTS:
        expected = llada_reference(model, prompt, MASK, 4, 4, 8, stop_ids=stop_ids, pad=pad)
        assert decode(model, cfg, prompt)[0].tolist() == expected[0].tolist()


def test_dllm_var_preset_on_a_llada_checkpoint(tmp_path):
    """dLLM-Var is a LLaDA checkpoint decoded as JetEngine serves it: block-causal with the cache, absolute blocks,
    the prompt's whole blocks prefilled seeing each other; one batch equals the plain loop prompt by prompt."""
    model = load(tmp_path, "llada", llada_config())
    cfg = BlockDiffusionConfig.from_preset("dllm_var", block_size=4, max_new_tokens=12, threshold=0.5)
    stop_ids, pad, resolved = stops(model, cfg)
    assert (resolved.attention, resolved.alignment, resolved.prompt_attention) == ("block_causal", "absolute",
                                                                                  "bidirectional")
    assert (resolved.mask_token_id, stop_ids) == (MASK, (94,))  # the LLaDA profile's, from the checkpoint config
    prompts = PROMPTS + [torch.tensor([11, 4, 70, 6, 19, 52, 3, 27, 45, 8, 30])]
    expected = [sdar_reference(model, p, MASK, 4, 4, 12, "low_confidence_dynamic", 0.5, stop_ids=stop_ids, pad=pad,
                               whole_prompt=True) for p in prompts]
    staircase = [sdar_reference(model, p, MASK, 4, 4, 12, "low_confidence_dynamic", 0.5, stop_ids=stop_ids,
                                pad=pad) for p in prompts]
    assert any(e[0].tolist() != s[0].tolist() for e, s in zip(expected, staircase))  # the prefill rule shows
    for prompt, (tokens, forwards) in zip(prompts, expected):
        got, got_forwards = decode(model, cfg, prompt)
        assert (got.tolist(), got_forwards) == (tokens.tolist(), forwards)
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    attention_mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    out = model.generate_multi_block(batch, cfg, attention_mask=attention_mask)
    assert [row.tolist() for row in out[:, width:]] == [e[0].tolist() for e in expected]


def test_dream_family(tmp_path):
    model = load(tmp_path, "dream", dream_config())
    cfg = BlockDiffusionConfig.from_preset("dream", max_new_tokens=10, steps_per_block=5, eos_token_id=[])
    resolved = stops(model, cfg)[2]
    assert (resolved.logit_shift, resolved.block_size) == (True, 10)
    for prompt in PROMPTS:
        expected = dream_reference(model, prompt, MASK, 10, 5, "entropy")
        tokens, forwards = decode(model, cfg, prompt)
        assert tokens.tolist() == expected[0].tolist() and forwards == expected[1]


@pytest.mark.parametrize("bd_size", [4, 8])
def test_fast_dllm_v2_family(tmp_path, bd_size):
    model = load(tmp_path, "fast_dllm", fast_dllm_config(mask_token_id=MASK, bd_size=bd_size))
    cfg = BlockDiffusionConfig.from_preset("fast_dllm_v2", max_new_tokens=13, sub_block_size=4, threshold=0.5)
    stop_ids, pad, resolved = stops(model, cfg)
    assert (resolved.block_size, resolved.logit_shift, resolved.alignment) == (bd_size, True, "absolute")
    for prompt in PROMPTS:
        expected = fast_dllm_v2_reference(model, prompt, MASK, bd_size, 4, 13, 0.5, stop_ids=stop_ids, pad=pad)
        assert decode(model, cfg, prompt)[0].tolist() == expected[0].tolist()
