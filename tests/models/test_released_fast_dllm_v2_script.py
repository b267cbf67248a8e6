"""Fast-dLLM v2's released `generation_functions.py` (`batch_sample`) runs on our `Fast_dLLM_QwenForCausalLM`:
`update_past_key_values` True to store a finished block and False to attend to the cache without storing,
`block_size`, and with `use_block_cache` the block cache (`block_past_key_values` returned, passed back with an int
`replace_position` for a sub-block), and the model's `sample_with_top_p`."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import fast_dllm_config
from script_harness import both_ways, load_family, shift_logits, take_confident
from torch_reference import block_causal, qwen_logits

from hf_blockdiff.model_patches.released.caches import ReleasedCache

MASK, BLOCK, SUB_BLOCK = 95, 8, 4


def denoise_sub_block(model, x, cache, block_cache, small, threshold, use_block_cache):
    """One step of `batch_sample`'s inner loop on sub-block `small` of the last block of `x`; the block cache."""
    length = x.shape[1]
    lo = length - BLOCK + small * SUB_BLOCK
    call = dict(use_cache=True, past_key_values=cache, update_past_key_values=False, canvas=x.clone())
    if use_block_cache and block_cache is not None and not (x[:, lo] == MASK).any():
        output = model(input_ids=x[:, lo:lo + SUB_BLOCK], use_block_cache=True, block_past_key_values=block_cache,
                       replace_position=small * SUB_BLOCK, span=slice(lo, lo + SUB_BLOCK),
                       fresh=slice(lo, lo + SUB_BLOCK), **call)
        logits = shift_logits(output.logits)
    else:
        extra = dict(use_block_cache=True, record=True) if use_block_cache else {}
        output = model(input_ids=x[:, -BLOCK:], span=slice(length - BLOCK, None), **extra, **call)
        block_cache = output.block_past_key_values if use_block_cache else None
        logits = shift_logits(output.logits)[:, small * SUB_BLOCK:(small + 1) * SUB_BLOCK]
    proposal, probs = model.sample_with_top_p(logits, top_p=0.95, temperature=0.0)
    confidence = probs.gather(-1, proposal[..., None])[..., 0]
    chosen = take_confident(confidence, x[:, lo:lo + SUB_BLOCK] == MASK, threshold)
    x[:, lo:lo + SUB_BLOCK][chosen] = proposal[chosen]
    return block_cache


def batch_sample(model, input_ids, max_new_tokens, threshold, use_block_cache):
    """The model calls of `batch_sample` for one prompt (greedy, `min_len` = `seq_len` = the prompt length)."""
    length = input_ids.shape[1]
    cache = None
    if length > BLOCK:
        prefix = length // BLOCK * BLOCK
        output = model(input_ids=input_ids[:, :prefix], use_cache=True, update_past_key_values=True,
                       block_size=BLOCK, canvas=input_ids[:, :prefix], span=slice(None))
        cache = output.past_key_values
        if length % BLOCK == 0:
            input_ids = torch.cat([input_ids, output.logits[:, -1:].argmax(-1)], 1)
    for _ in range(length // BLOCK, max_new_tokens // BLOCK + length // BLOCK):
        x = torch.cat([input_ids, torch.full((1, BLOCK - input_ids.shape[1] % BLOCK), MASK)], 1)
        block_cache = None
        for small in range(BLOCK // SUB_BLOCK):
            start = x.shape[1] - BLOCK + small * SUB_BLOCK
            while (x[:, start:start + SUB_BLOCK] == MASK).any():
                block_cache = denoise_sub_block(model, x, cache, block_cache, small, threshold, use_block_cache)
        output = model(input_ids=x[:, -BLOCK:], use_cache=True, past_key_values=cache, update_past_key_values=True,
                       block_size=BLOCK, canvas=x.clone(), span=slice(x.shape[1] - BLOCK, None))
        cache = output.past_key_values
        input_ids = torch.cat([x, output.logits[:, -1:].argmax(-1)], 1)
    return input_ids, cache


@pytest.mark.parametrize("use_block_cache", [False, True])
@pytest.mark.parametrize("prompt_length", [3, 10, 16])
def test_batch_sample_call_forms(tmp_path, use_block_cache, prompt_length):
    config = fast_dllm_config(mask_token_id=MASK, bd_size=BLOCK)
    model, state = load_family(tmp_path, config)

    def reference(canvas, stale, record):
        allowed = block_causal(canvas.shape[1], BLOCK)[None]
        return qwen_logits(state, config, canvas, allowed, stale=stale, record=record)

    prompt = torch.randint(0, 90, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    (tokens, cache), (reference_tokens, _), forms = both_ways(batch_sample, model, reference, prompt, 16, 0.9,
                                                              use_block_cache)
    assert torch.equal(tokens, reference_tokens) and (tokens != MASK).all()
    assert any("replace_position" in form for form in forms) == use_block_cache
    assert isinstance(cache, ReleasedCache) and cache.get_seq_length() == tokens.shape[1] - 1  # all but the next token
