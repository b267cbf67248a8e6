"""Plain re-implementations of the Dream, Fast-dLLM v1 (prefix/dual cache) and Fast-dLLM v2 loops, batch 1.

Like tests/reference_loops.py these use only the stock model (explicit 4D masks, DynamicCache built by hand for
the approximate caches) and share nothing with hf_blockdiff's loop. Greedy; the mask token is never proposed.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from reference_loops import finish, full_logits, staircase, top_positions


def dream_reference(model, prompt, mask_id, new, steps, alg="entropy", eps=1e-3):
    """Dream diffusion_generate: one block over the new tokens, exactly `steps` forwards; at step i commit
    ⌊M·(1 − s/t)⌋ masks (all at the last step) by confidence / margin / negative entropy; logits shifted."""
    p = len(prompt)
    x = torch.full((p + new,), mask_id, dtype=torch.long)
    x[:p] = prompt
    everything = torch.ones(p + new, p + new, dtype=torch.bool)
    timesteps = torch.linspace(1, eps, steps + 1, dtype=torch.float64)
    for i in range(steps):
        masked = [j for j in range(p, p + new) if x[j] == mask_id]
        logits = full_logits(model, x, everything, mask_id, shift=True)
        probs = torch.softmax(logits, -1)
        proposal = {j: int(logits[j].argmax()) for j in masked}
        top2 = {j: probs[j].topk(2).values for j in masked}
        score = {
            "maskgit_plus": {j: float(top2[j][0]) for j in masked},
            "topk_margin": {j: float(top2[j][0] - top2[j][1]) for j in masked},
            "entropy": {j: float((probs[j] * torch.log(probs[j].clamp_min(1e-30))).sum()) for j in masked},
        }[alg]
        count = len(masked) if i == steps - 1 else int(len(masked) * (1 - float(timesteps[i + 1] / timesteps[i])))
        for j in top_positions(score, count):
            x[j] = proposal[j]
    return finish(x, p, new, (), 0), steps


def forward_with_past(model, tokens, positions, past_keys, past_values):
    """Logits of `tokens` at `positions` attending to the given past K/V and to each other, all visible."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(past_keys, past_values)):
        cache.update(k, v, layer)
    width, past = len(tokens), past_keys[0].shape[2]
    bias = torch.zeros(1, 1, width, past + width)
    with torch.no_grad():
        out = model(input_ids=tokens[None], attention_mask=bias, position_ids=positions[None], past_key_values=cache,
                    use_cache=True)
    return out.logits[0].float()


def fast_dllm_reference(model, prompt, mask_id, block, new, threshold, cache="dual"):
    """Fast-dLLM v1 with an approximate cache: per block a full forward of the canvas (its logits decide step 0,
    its K/V are kept), then forwards of the block (dual: past = prefix and frozen suffix) or of block + suffix
    (prefix: past = prefix); threshold rule {c ≥ τ} ∪ top-1 with float64 confidences."""
    p = len(prompt)
    total = p + new
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:p] = prompt
    forwards = 0
    for k in range(math.ceil(new / block)):
        lo, hi = p + k * block, min(p + (k + 1) * block, total)
        bias = torch.zeros(1, 1, total, total)
        with torch.no_grad():
            out = model(input_ids=x[None], attention_mask=bias, position_ids=torch.arange(total)[None], use_cache=True)
        forwards += 1
        keys = [layer.keys for layer in out.past_key_values.layers]
        values = [layer.values for layer in out.past_key_values.layers]
        logits, offset = out.logits[0].float(), 0
        while True:
            logits = logits.clone()
            logits[:, mask_id] = float("-inf")
            masked = [i for i in range(lo, hi) if x[i] == mask_id]
            probs = torch.softmax(logits.double(), -1)
            confidence = {i: float(probs[i - offset].max()) for i in masked}
            chosen = {i for i in masked if confidence[i] >= threshold} | set(top_positions(confidence, 1))
            for i in chosen:
                x[i] = int(logits[i - offset].argmax())
            if all(x[i] != mask_id for i in range(lo, hi)):
                break
            end = hi if cache == "dual" else total
            past_k = [torch.cat([k_[:, :, :lo], k_[:, :, end:]], dim=2) for k_ in keys]
            past_v = [torch.cat([v_[:, :, :lo], v_[:, :, end:]], dim=2) for v_ in values]
            logits, offset = forward_with_past(model, x[lo:end], torch.arange(lo, end), past_k, past_v), lo
            forwards += 1
    return finish(x, p, new, (), 0), forwards


def fast_dllm_v2_reference(model, prompt, mask_id, block, sub_block, new, threshold, stop_ids=(), pad=0):
    """Fast-dLLM v2: absolute blocks with the prompt tail in the first one, staircase prefill; the prefill and every
    block's commit forward decide the next block's first token greedily; a block is decoded sub-block by
    sub-block with {c > τ} ∪ argmax c; logits shifted; full recompute under the staircase mask."""
    p = len(prompt)
    total = math.ceil((p + new) / block) * block
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:p] = prompt
    first = p // block * block
    forwards = 0

    def next_token(end):
        logits = full_logits(model, x[:end], staircase(end, p, block, "absolute"), mask_id, shift=False)
        if end < total and x[end] == mask_id:
            x[end] = int(logits[end - 1].argmax())

    if first > 0:
        next_token(first)
        forwards += 1
    for k in range(first // block, total // block):
        lo, hi = k * block, (k + 1) * block
        while any(x[i] == mask_id for i in range(lo, hi)):
            sb = next(s for s in range(lo, hi, sub_block) if any(x[i] == mask_id for i in range(s, s + sub_block)))
            masked = [i for i in range(sb, sb + sub_block) if x[i] == mask_id]
            logits = full_logits(model, x[:hi], staircase(hi, p, block, "absolute"), mask_id, shift=True)
            forwards += 1
            probs = torch.softmax(logits, -1)
            confidence = {i: float(probs[i].max()) for i in masked}
            chosen = {i for i in masked if confidence[i] > threshold} | set(top_positions(confidence, 1))
            for i in chosen:
                x[i] = int(logits[i].argmax())
        next_token(hi)
        forwards += 1
        if any(int(t) in stop_ids for t in x[p:hi]):
            break
    return finish(x, p, new, stop_ids, pad), forwards
