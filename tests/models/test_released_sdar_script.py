"""SDAR's released `generate.py` (JetAstra/SDAR, `block_diffusion_generate`) runs on our SDAR and SDAR-MoE classes: a
float 0/1 block-staircase mask of shape [1, q, k], explicit positions, a `DynamicCache`, `store_kv=True` for the
prefill and each finished block, `store_kv=False` for the denoising steps."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import sdar_config, sdar_moe_config
from script_harness import both_ways, load_family
from torch_reference import block_causal, qwen_logits
from transformers import DynamicCache

MASK = 95


def sdar_generate(model, prompt, gen_length, block_length, steps, threshold):
    """The model calls of `block_diffusion_generate` (sampling made greedy, `low_confidence_dynamic` remasking);
    returns the canvas and the cache."""
    prompt_length = prompt.shape[1]
    num_blocks = -(-(prompt_length + gen_length) // block_length)
    total = num_blocks * block_length
    staircase = torch.tril(torch.ones(num_blocks, num_blocks))
    mask = staircase.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[None]  # float [1, n, n]
    positions = torch.arange(total)[None]
    x = torch.full((1, total), MASK)
    x[:, :prompt_length] = prompt
    cache = DynamicCache()
    prefill = prompt_length // block_length * block_length
    if prefill:
        model(x[:, :prefill], attention_mask=mask[:, :prefill, :prefill], position_ids=positions[:, :prefill],
              past_key_values=cache, use_cache=True, store_kv=True, canvas=x[:, :prefill], span=slice(0, prefill))
    schedule = [block_length // steps + (step < block_length % steps) for step in range(steps)]
    for block in range(prompt_length // block_length, num_blocks):
        lo, hi = block * block_length, (block + 1) * block_length
        current = x[:, lo:hi].clone()
        for step in range(steps + 1):
            masked = current == MASK
            call = dict(attention_mask=mask[:, lo:hi, :hi], position_ids=positions[:, lo:hi], past_key_values=cache,
                        use_cache=True, canvas=torch.cat([x[:, :lo], current], 1), span=slice(lo, hi))
            if not masked.any():
                model(current, store_kv=True, **call)
                break
            probs = model(current, store_kv=False, **call).logits.softmax(-1)
            confidence, proposal = probs.max(-1)
            confidence = torch.where(masked, confidence, -torch.inf)
            chosen = confidence > threshold
            if chosen.sum() < schedule[step]:
                chosen = torch.zeros_like(masked)
                chosen[0, confidence[0].topk(schedule[step]).indices] = True
            current[chosen] = proposal[chosen]
        x[:, lo:hi] = current
    return x, cache


@pytest.mark.parametrize("config", [sdar_config, sdar_moe_config])
@pytest.mark.parametrize("prompt_length", [3, 6, 8])
def test_generate_py_call_forms(tmp_path, config, prompt_length):
    config = config()
    model, state = load_family(tmp_path, config)

    def reference(canvas, stale, record):
        return qwen_logits(state, config, canvas, block_causal(canvas.shape[1], 4)[None], stale=stale, record=record)

    prompt = torch.randint(0, 90, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    (tokens, cache), (reference_tokens, _), forms = both_ways(sdar_generate, model, reference, prompt, 10, 4, 4, 0.5)
    assert torch.equal(tokens, reference_tokens)
    assert (tokens != MASK).all() and torch.equal(tokens[:, :prompt_length], prompt)
    assert cache.get_seq_length() == tokens.shape[1]  # each block stored once: store_kv=False kept nothing
    assert len(forms) > tokens.shape[1] // 4 + 1  # denoising steps beside the stores
