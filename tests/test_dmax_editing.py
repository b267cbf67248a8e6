"""The `diffulex_edit` preset (editing with Diffulex's remasking, stability threshold, T2T edit penalty and step cap)
token for token against a NumPy twin of the rule (docs/architecture.md, "The decode loop"), and its bad inputs.

The twin decodes one prompt at a time and recomputes the window (prompt and blocks up to the active one) with the
stock model and a block-causal 4-D mask every step; only the logits come from torch, every rule is plain NumPy.
`generate_multi_block` decodes the prompts as one left-padded batch on the paged cache."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from reference_loops import full_logits, staircase

from helpers import MASK, left_pad, random_prompts, tiny_model

PAD = 92
LENGTHS, NEW = (5, 19, 34), 45
DEFAULTS = dict(block_size=32, steps_per_block=32, threshold=0.9, editing_threshold=0.4, remask_threshold=0.4,
                stability_threshold=1.0, edit_penalty=0.0, max_post_steps=16)  # the preset's, as the twin reads them


def sharp_model(head_scale):
    """The tiny Qwen3 with its LM head scaled: confidences spread around the thresholds, so commits, edits and
    remasks all happen."""
    model = tiny_model("qwen3", seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


class Twin:
    """The rule in NumPy for one prompt (greedy, absolute blocks, strategy confidence_threshold with c > τ)."""

    def __init__(self, model, settings, stop_ids=()):
        self.model, self.stop_ids = model, set(stop_ids)
        s = {**DEFAULTS, **settings}
        self.B, self.S, self.tau = s["block_size"], s["steps_per_block"], s["threshold"]
        self.eps, self.rho, self.sigma = s["editing_threshold"], s["remask_threshold"], s["stability_threshold"]
        self.lam, self.max_post = s["edit_penalty"], s["max_post_steps"]
        self.fired = Counter()

    def scores(self, x, p, lo, hi):
        """Proposal and confidence of the block's positions, the penalty on the token before each (in the block)."""
        logits = full_logits(self.model, torch.tensor(x[:hi]), staircase(hi, p, self.B, "absolute"), MASK,
                             False)[lo:hi].numpy()
        plain = logits.argmax(-1)
        for j in range(1, self.B):
            logits[j, x[lo + j - 1]] -= np.float32(self.lam)
        proposal = logits.argmax(-1)
        self.fired["penalized"] += int(((proposal != plain) & (np.arange(lo, hi) >= p)).sum())
        z = np.exp(logits - logits.max(-1, keepdims=True))
        return proposal, (z.max(-1) / z.sum(-1)).astype(np.float32)

    def decode(self, prompt, new):
        """(generated tokens with PAD after the first stop token and at undecided positions, commit step of each
        (twin steps, 1-based; -1 for PAD), decoding steps)."""
        p, B = len(prompt), self.B
        first = p // B * B
        end = first + -(-(p + new - first) // B) * B
        x, commit = np.full(end, MASK), np.full(end, -1)
        x[:p] = prompt.numpy()
        self.step = 0
        for lo in range(first, end, B):
            if self.block(x, commit, p, new, lo):
                break
        out, kept = x[p:p + new].copy(), commit[p:p + new].copy()
        stops = [i for i, t in enumerate(out) if t in self.stop_ids]
        dropped = (out == MASK) | (np.arange(new) > (stops[0] if stops else new))
        out[dropped], kept[dropped] = PAD, -1
        return out, kept, self.step

    def block(self, x, commit, p, new, lo):
        """Decode the block at `lo` until it completes; True when the slot stopped."""
        hi, steps, posts = lo + self.B, 0, 0
        position = np.arange(lo, hi)
        while True:
            proposal, conf = self.scores(x, p, lo, hi)
            masked = x[lo:hi] == MASK
            decided = ~masked & (position >= p)
            self.step, steps = self.step + 1, steps + 1
            final, post = steps >= self.S + self.max_post, not masked.any()
            take = masked & (conf > self.tau)
            if masked.any():
                take[np.argmax(np.where(masked, conf, -1.0))] = True
            self.fired["capped"] += int(final and (masked & ~take).any())
            take = masked if final else take
            remask = decided & (conf < self.rho) & (not final) if self.rho is not None else np.zeros_like(decided)
            edit = decided & ~remask & (proposal != x[lo:hi]) & (conf > self.eps)
            written = take | edit
            x[lo:hi] = np.where(written, proposal, np.where(remask, MASK, x[lo:hi]))
            commit[lo:hi] = np.where(written, self.step, np.where(remask, -1, commit[lo:hi]))
            self.fired.update(edits=int(edit.sum()), remasks=int(remask.sum()))
            posts += post
            changed = int((edit | remask).sum())
            unstable = decided.sum() - changed < self.sigma * decided.sum()
            more = (unstable and posts <= self.max_post) if post else steps < self.S
            filled = not (x[lo:hi] == MASK).any()
            self.fired["stable_with_changes"] += int(post and filled and changed > 0 and not unstable)
            if self.stopped(x, written, p, new, lo):
                return True
            if filled and (final or not more):
                return False

    def stopped(self, x, written, p, new, lo):
        """The step wrote a stop token among the generated positions and none before the first one is undecided."""
        generated = range(p, p + new)
        wrote = any(written[i - lo] and x[i] in self.stop_ids for i in generated if lo <= i < lo + self.B)
        stops = [i for i in generated if x[i] in self.stop_ids]
        return wrote and not (x[p:stops[0]] == MASK).any()


def ours(model, prompts, settings, eos, **extra):
    ids, attention_mask = left_pad(prompts, PAD)
    cfg = BlockDiffusionConfig.from_preset("diffulex_edit", max_new_tokens=NEW, mask_token_id=MASK, pad_token_id=PAD,
                                           eos_token_id=[] if eos is None else eos, **settings, **extra)
    out = model.generate_multi_block(ids, cfg, attention_mask=attention_mask, return_dict=True)
    return out.sequences[:, ids.shape[1]:], out


def check(model, prompts, settings, eos):
    """Tokens, edits, steps and commit steps equal the twin's for every prompt; returns what fired in the twin."""
    tokens, out = ours(model, prompts, settings, eos)
    offset = int(any(len(p) >= settings.get("block_size", 32) for p in prompts))  # the batch's prefill forward
    fired = Counter()
    for row, prompt in enumerate(prompts):
        twin = Twin(model, settings, () if eos is None else (eos,))
        expected, commit, steps = twin.decode(prompt, NEW)
        assert tokens[row].tolist() == expected.tolist()
        assert int(out.edits[row]) == twin.fired["edits"]
        assert int(out.steps[row]) == steps
        assert out.commit_step[row].tolist() == np.where(commit >= 0, commit + offset, -1).tolist()
        fired += twin.fired
    return fired, tokens


# head scales chosen off near-ties: the twin scores in NumPy, so a confidence within an ulp of a threshold may fall
# either way (at 2.0, step_cap's edits differed by one once sdpa read keys in multiples of 64)
SETTINGS = {
    "preset": ({}, 2.0),
    "penalty_and_stability": (dict(block_size=16, steps_per_block=16, edit_penalty=1.5, stability_threshold=0.375,
                                   max_post_steps=3, editing_threshold=0.5, remask_threshold=0.3), 1.5),
    "step_cap": (dict(block_size=8, steps_per_block=2, max_post_steps=1, remask_threshold=0.6, threshold=0.95), 2.1),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_diffulex_edit_matches_the_numpy_twin(name):
    """Without EOS, then with a token the model emits mid-way as EOS; the rules the setting is about must fire."""
    settings, head_scale = SETTINGS[name]
    model, prompts = sharp_model(head_scale), random_prompts(LENGTHS, seed=7)
    fired, tokens = check(model, prompts, settings, None)
    assert fired["edits"] > 0 and fired["remasks"] > 0
    if name == "penalty_and_stability":
        assert fired["penalized"] > 0 and fired["stable_with_changes"] > 0
    if name == "step_cap":
        assert fired["capped"] > 0
    in_prompts = set(torch.cat(prompts).tolist())
    eos = next(int(t) for t in tokens[:, NEW // 3:].flatten() if int(t) not in in_prompts and int(t) != PAD)
    _, with_eos = check(model, prompts, settings, eos)
    assert any(eos in row[:-1].tolist() for row in with_eos)  # some prompt stopped before its end


def test_fixed_shape_steps_decode_the_same():
    """The step with fixed capacities (what a CUDA graph captures; run eagerly off CUDA) gives the same tokens."""
    settings, head_scale = SETTINGS["penalty_and_stability"]
    model, prompts = sharp_model(head_scale), random_prompts(LENGTHS, seed=7)
    plain, _ = ours(model, prompts, settings, None)
    fixed, _ = ours(model, prompts, settings, None, cuda_graphs=True)
    assert torch.equal(plain, fixed)


@pytest.mark.parametrize("field, value, message", [
    ("remask_threshold", 0.0, r"pass a confidence in \(0, 1\]"),
    ("remask_threshold", 1.5, r"pass a confidence in \(0, 1\]"),
    ("stability_threshold", -0.1, r"pass a fraction in \[0, 1\]"),
    ("stability_threshold", True, r"pass a fraction in \[0, 1\]"),
    ("edit_penalty", -1.0, "pass a non-negative number"),
])
def test_bad_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=f"BlockDiffusionConfig.{field}={value!r} is invalid: {message}"):
        BlockDiffusionConfig.from_preset("diffulex_edit", **{field: value})


@pytest.mark.parametrize("field, value", [("remask_threshold", 0.4), ("stability_threshold", 0.5),
                                          ("edit_penalty", 1.0)])
def test_dmax_rules_need_editing(field, value):
    with pytest.raises(ValueError, match=f"BlockDiffusionConfig.{field}={value!r} is invalid: it is a rule of "
                                         "editable decoding: set editing_threshold"):
        BlockDiffusionConfig.from_preset("llada2", **{field: value})
