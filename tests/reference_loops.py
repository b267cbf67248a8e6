"""Plain re-implementations of the reference decode loops (docs/fidelity.md, "Presets"), batch 1, no cache.

Every denoise step recomputes the whole canvas with the stock model and an explicit 4D mask, so these loops share
nothing with hf_blockdiff's cache, attention dispatch, windows or strategies. Greedy decoding; the mask token is
never proposed (docs/architecture.md, "Scoring and strategies"). Each returns (generated tokens [max_new_tokens] with `pad` after the first stop token,
number of forwards the reference makes).
"""

from __future__ import annotations

import math

import torch


def full_logits(model, tokens: torch.Tensor, allowed: torch.Tensor, mask_id: int, shift: bool) -> torch.Tensor:
    """fp32 logits [L, V] of a 1-D token sequence under the boolean attention rule allowed[query, key]."""
    length = len(tokens)
    bias = torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    device = model.device  # the loop's tensors stay on the CPU; a GPU model sees copies
    with torch.no_grad():
        logits = model(input_ids=tokens[None].to(device), attention_mask=bias.to(device),
                       position_ids=torch.arange(length, device=device)[None]).logits[0]
    if shift:
        logits = torch.cat([logits[:1], logits[:-1]], dim=0)
    logits = logits.float().cpu()
    if mask_id is not None:
        logits[:, mask_id] = float("-inf")
    return logits


def block_ids(length: int, prompt_len: int, block: int, alignment: str) -> torch.Tensor:
    positions = torch.arange(length)
    if alignment == "absolute":
        return positions // block
    return torch.where(positions < prompt_len, 0, (positions - prompt_len) // block + 1)


def staircase(length: int, prompt_len: int, block: int, alignment: str) -> torch.Tensor:
    ids = block_ids(length, prompt_len, block, alignment)
    return ids[:, None] >= ids[None, :]


def num_transfer(length: int, steps: int) -> list[int]:
    return [length // steps + (1 if t < length % steps else 0) for t in range(steps)]


def finish(x: torch.Tensor, prompt_len: int, new: int, stop_ids, pad: int | None) -> torch.Tensor:
    """The generated part, `pad` after the first stop token (kept as is when pad is None)."""
    out = x[prompt_len : prompt_len + new].clone()
    for i, token in enumerate(out.tolist()):
        if token in stop_ids and pad is not None:
            out[i + 1 :] = pad
            break
    return out


def top_positions(score: dict[int, float], n: int, largest: bool = True) -> list[int]:
    """The n positions with the largest (or smallest) score; ties → lowest position."""
    order = sorted(score, key=lambda p: ((-score[p]) if largest else score[p], p))
    return order[:n]


def sdar_reference(model, prompt, mask_id, block, steps, new, strategy, threshold=0.9, fallback="topk",
                   stop_ids=(), pad=0, record=None, whole_prompt=False, minimal_topk=None):
    """SDAR generate.py: absolute blocks, staircase prefill of ⌊P/B⌋·B tokens, prompt tail in the first block,
    read-only denoise forwards, one store forward per block, stop checked after each block.
    `record` (a dict) receives position → (1-based forward index, probability, entropy) of each committed token.
    `whole_prompt`: the ⌊P/B⌋·B prefilled tokens see each other (JetEngine's LLaDA prefill) instead of a staircase.
    `minimal_topk`: diffusers' LLaDA2Pipeline, `steps = min(steps, gen_length // minimal_topk)` before decoding."""
    p = len(prompt)
    if minimal_topk is not None:
        steps = min(steps, new // minimal_topk)
    total = math.ceil((p + new) / block) * block
    allowed = staircase(total, p, block, "absolute")
    if whole_prompt:
        allowed[: p // block * block, : p // block * block] = True
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:p] = prompt
    forwards = 1 if p // block > 0 else 0
    schedule = num_transfer(block, steps)
    for k in range(p // block, total // block):
        lo, hi = k * block, (k + 1) * block
        for step in range(steps + 1):
            masked = [i for i in range(lo, hi) if x[i] == mask_id]
            forwards += 1
            if not masked:
                break  # the store forward
            logits = full_logits(model, x[:hi], allowed[:hi, :hi], mask_id, False)
            probs = torch.softmax(logits, -1)
            proposal = {i: int(logits[i].argmax()) for i in masked}
            confidence = {i: float(probs[i, proposal[i]]) for i in masked}
            n = schedule[step]
            if strategy == "sequential":
                chosen = masked[:n]
            elif strategy == "low_confidence_static":
                chosen = top_positions(confidence, n)
            elif strategy == "low_confidence_dynamic":
                chosen = [i for i in masked if confidence[i] > threshold]
                if len(chosen) < n:
                    chosen = top_positions(confidence, n) if fallback == "topk" else masked[:n]
            else:
                raise ValueError(strategy)
            for i in chosen:
                x[i] = proposal[i]
                if record is not None:
                    entropy = float(-(probs[i] * torch.log(probs[i].clamp_min(1e-30))).sum())
                    record[i - p] = (forwards, confidence[i], entropy)
        if any(int(t) in stop_ids for t in x[p:]):
            break
    return finish(x, p, new, stop_ids, pad), forwards


def llada_reference(model, prompt, mask_id, block, steps, new, remasking="low_confidence", threshold=None,
                    stop_ids=(), pad=0, shift=False, temperature=0.0, noise=None, cfg_scale=0.0):
    """LLaDA generate.py: prompt_end blocks, bidirectional full recompute, exactly `steps` forwards per block,
    get_num_transfer_tokens over the block's masks, confidence from a float64 softmax, later blocks excluded.
    remasking="threshold" is Fast-dLLM v1's parallel decoding: {c ≥ τ} ∪ top-1 until the block is done.
    At temperature > 0 proposals are argmax(ℓ/T + g) in float64 with Gumbel noise `noise(position, draw)` and the
    confidence stays softmax(ℓ); cfg_scale > 0 mixes in the logits of the canvas with the prompt masked."""
    p = len(prompt)
    x = torch.full((p + new,), mask_id, dtype=torch.long)
    x[:p] = prompt
    everything = torch.ones(p + new, p + new, dtype=torch.bool)
    forwards = 0
    for k in range(math.ceil(new / block)):
        lo, hi = p + k * block, min(p + (k + 1) * block, p + new)
        schedule = num_transfer(sum(int(x[i] == mask_id) for i in range(lo, hi)), steps)
        step = 0
        while any(x[i] == mask_id for i in range(lo, hi)) if remasking == "threshold" else step < steps:
            masked = [i for i in range(lo, hi) if x[i] == mask_id]
            logits = full_logits(model, x, everything, None, shift).double()
            if cfg_scale > 0:
                unconditional = x.clone()
                unconditional[:p] = mask_id
                un = full_logits(model, unconditional, everything, None, shift).double()
                logits = un + (cfg_scale + 1) * (logits - un)
            logits[:, mask_id] = float("-inf")
            forwards += 1
            probs = torch.softmax(logits, -1)
            if temperature > 0:
                proposal = {i: int((logits[i] / temperature + noise(i, forwards - 1).double()).argmax()) for i in masked}
            else:
                proposal = {i: int(logits[i].argmax()) for i in masked}
            confidence = {i: float(probs[i, proposal[i]]) for i in masked}
            if remasking == "threshold":
                chosen = [i for i in masked if confidence[i] >= threshold]
                chosen = sorted(set(chosen) | set(top_positions(confidence, 1)))
            else:
                chosen = top_positions(confidence, schedule[step])
            for i in chosen:
                x[i] = proposal[i]
            step += 1
        if stop_ids and any(int(t) in stop_ids for t in x[p:hi]):
            break
    return finish(x, p, new, stop_ids, pad), forwards


def multi_block_reference(model, prompt, mask_id, block, new, threshold, block_add_threshold,
                          decoded_token_threshold, max_active_blocks=10**9, shift=True, stop_ids=(), pad=0,
                          activation_on_add=None, eos_fill=False, bidirectional=False, strict=True, slot_top1=False):
    """d3LLM-style multi-block decoding (docs/architecture.md, "The decode loop" and docs/fidelity.md, "Presets") with entropy threshold and
    forced progress: prompt_end blocks, the prompt is block 0, full recompute of the canvas each step, block-causal
    over blocks or, with `bidirectional`, every position seeing the whole canvas, blocks not yet added included
    (d3LLM's d3llm_dream_generate_util.py and d3llm_llada_generate_util.py run model(x) on the full canvas).
    Per step: (1) blocks whose predecessor reached `decoded_token_threshold` become fully activated; (2) one block
    is added, fully activated at once if its predecessor reached `activation_on_add`; (3) a forward and the choice of
    `entropy_choice`; with `eos_fill` the first decided stop token overwrites every later position before the next
    forward."""
    p = len(prompt)
    x = torch.full((p + new,), mask_id, dtype=torch.long)
    x[:p] = prompt
    spans = [(p + k * block, min(p + (k + 1) * block, p + new)) for k in range(math.ceil(new / block))]
    allowed = staircase(p + new, p, block, "prompt_end")
    if bidirectional:
        allowed = torch.ones_like(allowed)

    def progress(k):
        if k < 0:
            return 1.0
        lo, hi = spans[k]
        return sum(int(x[i] != mask_id) for i in range(lo, hi)) / (hi - lo)

    on_add = decoded_token_threshold if activation_on_add is None else activation_on_add
    added, full, forwards = 0, set(), 0
    while True:
        if eos_fill:
            for i in range(p, p + new):
                if int(x[i]) in stop_ids:
                    x[i + 1:] = x[i]
                    break
        for k in range(added):
            if progress(k - 1) >= decoded_token_threshold:
                full.add(k)
        incomplete = [k for k in range(added) if progress(k) < 1.0]
        last = progress(added - 1)
        if added < len(spans) and (last >= block_add_threshold or last == 1.0) and len(incomplete) < max_active_blocks:
            added += 1
            if progress(added - 2) >= on_add:
                full.add(added - 1)
        active = [k for k in range(added) if progress(k) < 1.0]
        stop_at = first_settled_stop(x, p, new, spans, mask_id, stop_ids)
        if stop_at is not None or (not active and added == len(spans)):
            break
        logits = full_logits(model, x, allowed, mask_id, shift)
        forwards += 1
        probs = torch.softmax(logits.double(), -1)
        entropy = -(probs * torch.log(probs.clamp_min(1e-300))).sum(-1)
        masked = {k: [i for i in range(*spans[k]) if x[i] == mask_id] for k in active}
        forced = min((k for k in active if k in full), default=None)
        for i in entropy_choice(masked, forced, entropy, threshold, strict, slot_top1):
            x[i] = int(logits[i].argmax())
    return finish(x, p, new, stop_ids, pad if not eos_fill else None), forwards


def entropy_choice(masked, forced, entropy, threshold, strict, slot_top1):
    """The positions one step commits, given each active block's masked positions: those with H < τ (H ≤ τ unless
    `strict`: d3LLM's LLaDA loop drops only H > τ); with `slot_top1` the lowest-H masked position of all active blocks
    when none passes (get_transfer_index_entropy always keeps its top-1); then, if the `forced` block (the lowest fully
    activated one with masks) got nothing, its lowest-H masked position."""
    lowest = lambda positions: set(top_positions({i: float(entropy[i]) for i in positions}, 1, largest=False))
    candidates = [i for positions in masked.values() for i in positions]
    chosen = {i for i in candidates if (float(entropy[i]) < threshold if strict else float(entropy[i]) <= threshold)}
    if slot_top1 and not chosen:
        chosen = lowest(candidates)
    if forced is not None and not chosen & set(masked[forced]):
        chosen |= lowest(masked[forced])
    return chosen


def first_settled_stop(x, p, new, spans, mask_id, stop_ids):
    """Position of the first stop token once its block and everything before it is decided, else None."""
    for k, (lo, hi) in enumerate(spans):
        if any(int(x[i]) == mask_id for i in range(lo, hi)):
            return None
        for i in range(lo, min(hi, p + new)):
            if int(x[i]) in stop_ids:
                return i
    return None
