"""Dream's released sampling code runs on our `DreamModel`: `generation_utils.py` (`model(x, "full", tok_idx)`, and a
boolean [b, 1, n, n] padding mask with per-row positions `tok_idx`) and Fast-dLLM v1's `generation_utils_block.py`
(`use_cache=True`, cache tuples [batch, length, width] sliced to a prefix and passed back, or `dual_cache=True` with
`replace_position`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from released_checkpoints import dream_config
from script_harness import MASK, both_ways, check_fast_dllm_block_script, confident_tokens, load_family, shift_logits
from torch_reference import qwen_logits
from transformers import AutoModel



def dream_sample(model, input_ids, attention_mask, max_length, steps, eps=1e-3):
    """The model calls of `DreamGenerationMixin._sample` (alg "maskgit_plus", temperature 0)."""
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=MASK)
    if attention_mask is not None and (attention_mask == 0).any():
        attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1)
        tok_idx = attention_mask.long().cumsum(-1) - 1
        tok_idx.masked_fill_(attention_mask == 0, 1)
        attention_mask = torch.logical_and(attention_mask.unsqueeze(1).unsqueeze(-2),
                                           attention_mask.unsqueeze(1).unsqueeze(-1))
    else:
        tok_idx, attention_mask = None, "full"
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = x == MASK
        logits = shift_logits(model(x, attention_mask, tok_idx, canvas=x.clone(), span=slice(None)).logits)
        confidence, proposal = logits[masked].softmax(-1).max(-1)
        count = masked.sum() / masked.shape[0]
        count = int(count * (1 - timesteps[i + 1] / timesteps[i])) if i < steps - 1 else int(count)
        full_confidence = torch.full(x.shape, -torch.inf)
        full_confidence[masked] = confidence
        if count > 0:
            transfer = full_confidence.topk(count).indices
            candidates = torch.full_like(x, MASK)
            candidates[masked] = proposal
            rows = torch.arange(len(x))[:, None].expand_as(transfer)
            x[rows, transfer] = candidates[rows, transfer]
    return x


def dream_block_sample(model, input_ids, gen_length, block_length, threshold, dual_cache):
    """The model calls of Fast-dLLM's block `_sample` for an unpadded prompt (mask "full", alg
    "confidence_threshold")."""
    prompt_length = input_ids.shape[1]
    x = F.pad(input_ids, (0, gen_length), value=MASK)
    for block in range(gen_length // block_length):
        start, end = prompt_length + block * block_length, prompt_length + (block + 1) * block_length
        output = model(x, "full", None, use_cache=True, canvas=x.clone(), span=slice(None), record=True)
        x[:, start] = shift_logits(output.logits)[:, start].argmax(-1)
        cache, call = output.past_key_values, dict(past_key_values=None, use_cache=True)
        if dual_cache:
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, start:end] = True
            call.update(dual_cache=True, replace_position=replace_position, span=slice(start, end))
        else:
            cache = [tuple(states[:, :start, :] for states in cache[i]) for i in range(len(cache))]
            call.update(span=slice(start, None))
        call["past_key_values"] = cache
        while (x[:, start:end] == MASK).any():
            span = call["span"]
            output = model(x[:, span], "full", None, canvas=x.clone(), fresh=span, **call)
            logits = shift_logits(output.logits)[:, :block_length]
            proposal, chosen = confident_tokens(logits, x[:, start:end] == MASK, threshold)
            x[:, start:end][chosen] = proposal[chosen]
    return x


@pytest.fixture
def dream(tmp_path):
    config = dream_config()
    model, state = load_family(tmp_path, config, AutoModel)  # the released auto_map: AutoModel is the LM
    return model, state, config


def test_generation_utils_full_mask(dream):
    model, state, config = dream

    def reference(canvas, stale, record):
        return qwen_logits(state, config, canvas, torch.ones(1, canvas.shape[1], canvas.shape[1], dtype=torch.bool))

    prompt = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    tokens, reference_tokens, forms = both_ways(dream_sample, model, reference, prompt, torch.ones(2, 6), 14, 4)
    assert torch.equal(tokens, reference_tokens) and (tokens != MASK).all() and len(forms) == 4


def test_generation_utils_padding_mask_and_positions(dream):
    model, state, config = dream
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kept = F.pad(padding, (0, 8), value=1).bool()
    positions = (kept.long().cumsum(-1) - 1).masked_fill(~kept, 1)

    def reference(canvas, stale, record):
        return qwen_logits(state, config, canvas, kept[:, None, :] & kept[:, :, None], positions=positions)

    prompt = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(1)).masked_fill(padding == 0, 93)
    tokens, reference_tokens, _ = both_ways(dream_sample, model, reference, prompt, padding, 14, 4)
    assert torch.equal(tokens, reference_tokens) and (tokens != MASK).all()


@pytest.mark.parametrize("dual_cache", [False, True])
def test_fast_dllm_block_generation(dream, dual_cache):
    model, state, config = dream
    check_fast_dllm_block_script(dream_block_sample, model, qwen_logits, state, config, 2, dual_cache)
