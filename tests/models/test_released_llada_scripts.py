"""LLaDA's released generate scripts run on our LLaDA classes: LLaDA's `generate.py` (loaded with `AutoModel`,
`model(x, attention_mask=padding).logits`, the doubled batch of classifier-free guidance) and Fast-dLLM v1's
`generate.py` (`generate_with_prefix_cache`: cache tuples sliced to a prefix and passed back;
`generate_with_dual_cache`: the whole cache with `replace_position`)."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import llada_config
from script_harness import MASK, both_ways, check_fast_dllm_block_script, confident_tokens, load_family
from torch_reference import key_padding, llada_logits
from transformers import AutoModel

from hf_blockdiff.model_patches.llada import LLaDAModelLM



def transfer_schedule(masked, steps):
    """`get_num_transfer_tokens`: the block's masks spread evenly over the steps, the remainder first."""
    count = masked.sum(1, keepdim=True)
    return count // steps + (torch.arange(steps)[None] < count % steps)


def llada_generate(model, prompt, attention_mask, steps, gen_length, block_length, cfg_scale):
    """The model calls of LLaDA's `generate` (temperature 0, "low_confidence" remasking)."""
    batch, prompt_length = prompt.shape
    x = torch.cat([prompt, torch.full((batch, gen_length), MASK)], 1)
    attention_mask = torch.cat([attention_mask, torch.ones(batch, gen_length, dtype=attention_mask.dtype)], -1)
    prompt_index = x != MASK
    num_blocks = gen_length // block_length
    for block in range(num_blocks):
        end = prompt_length + (block + 1) * block_length
        schedule = transfer_schedule(x[:, end - block_length:end] == MASK, steps // num_blocks)
        for step in range(steps // num_blocks):
            masked = x == MASK
            if cfg_scale > 0:
                unconditional = x.masked_fill(prompt_index, MASK)
                both = torch.cat([x, unconditional])
                logits = model(both, attention_mask=torch.cat([attention_mask] * 2), canvas=both,
                               span=slice(None)).logits
                conditional, unconditional = logits.chunk(2)
                logits = unconditional + (cfg_scale + 1) * (conditional - unconditional)
            else:
                logits = model(x, attention_mask=attention_mask, canvas=x, span=slice(None)).logits
            confidence, proposal = logits.softmax(-1).max(-1)
            confidence[:, end:] = -torch.inf
            confidence = torch.where(masked, confidence, -torch.inf)
            for row in range(batch):
                chosen = confidence[row].topk(int(schedule[row, step])).indices
                x[row, chosen] = proposal[row, chosen]
    return x


def fast_dllm_generate(model, prompt, gen_length, block_length, threshold, dual_cache):
    """The model calls of Fast-dLLM v1's `generate_with_prefix_cache` / `generate_with_dual_cache` (threshold
    decoding)."""
    prompt_length = prompt.shape[1]
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], 1)
    for block in range(gen_length // block_length):
        start, end = prompt_length + block * block_length, prompt_length + (block + 1) * block_length
        output = model(x, use_cache=True, canvas=x.clone(), span=slice(None), record=True)
        masked = x == MASK
        masked[:, end:] = False
        proposal, chosen = confident_tokens(output.logits, masked, threshold)
        x[chosen] = proposal[chosen]
        cache, call = output.past_key_values, {}
        if dual_cache:
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, start:end] = True
            span, call = slice(start, end), dict(replace_position=replace_position)
        else:
            cache = [tuple(states[:, :, :start] for states in cache[i]) for i in range(len(cache))]
            span = slice(start, None)
        while (x[:, start:end] == MASK).any():
            logits = model(x[:, span], past_key_values=cache, use_cache=True, canvas=x.clone(), span=span, fresh=span,
                           **call).logits
            masked = x[:, span] == MASK
            masked[:, block_length:] = False
            proposal, chosen = confident_tokens(logits, masked, threshold)
            x[:, span][chosen] = proposal[chosen]
    return x


@pytest.fixture
def llada(tmp_path):
    config = llada_config()
    model, state = load_family(tmp_path, config, AutoModel)  # as generate.py loads it
    assert isinstance(model, LLaDAModelLM)
    return model, state, config


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_generate_py_with_padding(llada, cfg_scale):
    model, state, config = llada
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    prompt = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(0)).masked_fill(attention_mask == 0,
                                                                                                  94)
    padding = torch.cat([attention_mask, torch.ones(2, 8, dtype=torch.long)], -1)

    def reference(canvas, stale, record):
        return llada_logits(state, config, canvas, key_padding(padding.repeat(len(canvas) // 2, 1)))

    tokens, reference_tokens, forms = both_ways(llada_generate, model, reference, prompt, attention_mask, 8, 8, 4,
                                                cfg_scale)
    assert torch.equal(tokens, reference_tokens) and (tokens != MASK).all() and len(forms) == 8


@pytest.mark.parametrize("dual_cache", [False, True])
def test_fast_dllm_v1_generate_py(llada, dual_cache):
    model, state, config = llada
    check_fast_dllm_block_script(fast_dllm_generate, model, llada_logits, state, config, 1, dual_cache)
