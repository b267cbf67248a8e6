"""The `llada2` and `llada2_1` presets against diffusers' LLaDA2Pipeline + BlockRefinementScheduler (editing off and
on, greedy, fp32).

diffusers runs one prompt at a time through a thin adapter (tools/diffusers_reference.py, glue only: the pipeline passes
a 2-D mask over the canvas, the adapter turns it into the block-causal 4-D mask the released model expects);
`generate_multi_block` decodes all prompts as one left-padded batch. Prompt + new tokens end on a block boundary:
diffusers hides the canvas past `P + gen_length` from every key (its 2-D mask), the released `generate` and we do
not, so only there the last block could differ (docs/fidelity.md, "Presets")."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
from hf_blockdiff.tools.diffusers_reference import llada2_pipeline

MASK, PAD, BLOCK = 95, 92, 32


def tiny_model(head_scale=6.0):
    config = LLaDA2MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        moe_intermediate_size=16, pad_token_id=PAD, eos_token_id=None, block_size=BLOCK, use_cache=False,
    )
    model = LLaDA2MoeModelLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            is_norm = "norm" in name
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * (0.1 if is_norm else 0.5) + is_norm)
        model.lm_head.weight.mul_(head_scale)  # 6: sharp logits, so the 0.7 threshold fires
        model.lm_head.weight[MASK] = 0.0  # logit 0 where the others reach tens: the mask is never proposed
    return model


def diffusers_tokens(model, prompt, gen_length, eos, editing_threshold=None, threshold=0.7, minimal_topk=1):
    """The generated tokens and how many forwards the pipeline ran (32 steps per block of 32, at most
    gen_length // minimal_topk; 16 post steps)."""
    settings = BlockDiffusionConfig(mask_token_id=MASK, block_size=BLOCK, steps_per_block=32, max_new_tokens=gen_length,
                                    threshold=threshold, editing_threshold=editing_threshold, max_post_steps=16,
                                    minimal_topk=minimal_topk)
    sequences, forwards = llada2_pipeline(model, prompt[None], settings, eos)
    return sequences[0], forwards


def ours(model, prompts, gen_length, eos, preset="llada2", **overrides):
    """Generated tokens [N, gen_length] of one left-padded batch, and the output (edits per row)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    attention_mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], attention_mask[row, width - len(prompt):] = prompt, 1
    cfg = BlockDiffusionConfig.from_preset(preset, max_new_tokens=gen_length, mask_token_id=MASK,
                                           eos_token_id=eos if eos is not None else [], pad_token_id=PAD, **overrides)
    out = model.generate_multi_block(ids, cfg, attention_mask=attention_mask, return_dict=True)
    return out.sequences[:, width:], out


def _prompts(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=generator) for n in lengths]


def check_against_diffusers(lengths, gen_length, preset, editing_threshold=None, threshold=0.7, head_scale=6.0,
                            minimal_topk=1):
    """Without EOS, then with a token the model emits mid-way (and no prompt holds) as EOS, so the EOS rule is
    exercised; returns the edit counts of both calls and whether every prompt took as many steps as diffusers'
    forwards (with editing off diffusers spends one more forward on a block filled before its last step)."""
    model, prompts = tiny_model(head_scale), _prompts(lengths, seed=sum(lengths))
    overrides = dict(threshold=threshold, minimal_topk=minimal_topk,
                     **({} if editing_threshold is None else dict(editing_threshold=editing_threshold)))
    settings = (editing_threshold, threshold, minimal_topk)
    without_eos, out = ours(model, prompts, gen_length, None, preset, **overrides)
    same_steps = True
    for row, prompt in enumerate(prompts):
        expected, forwards = diffusers_tokens(model, prompt, gen_length, None, *settings)
        assert without_eos[row].tolist() == expected.tolist()
        same_steps &= int(out.steps[row]) == forwards
    in_prompts = set(torch.cat(prompts).tolist())  # diffusers never stops a prompt that holds its EOS
    eos = next(int(t) for t in without_eos[:, gen_length // 3:].flatten() if int(t) not in in_prompts)
    with_eos, out_eos = ours(model, prompts, gen_length, eos, preset, **overrides)
    stopped = 0
    for row, prompt in enumerate(prompts):
        (expected, forwards), got = diffusers_tokens(model, prompt, gen_length, eos, *settings), with_eos[row]
        same_steps &= int(out_eos.steps[row]) == forwards
        hits = (expected == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else gen_length  # diffusers leaves whatever follows its EOS
        assert got[:end].tolist() == expected[:end].tolist()
        assert (got[end:] == PAD).all()
        stopped += len(hits) > 0
    assert stopped > 0
    return out.edits, out_eos.edits, same_steps


@pytest.mark.parametrize("lengths, gen_length", [((5, 37, 69), 59), ((17, 49, 81), 47)])
def test_llada2_preset_matches_diffusers(lengths, gen_length):
    edits, edits_eos, _ = check_against_diffusers(lengths, gen_length, "llada2")
    assert not edits.any() and not edits_eos.any()


@pytest.mark.parametrize("preset, threshold", [("llada2", 0.95), ("llada2_1", 0.9)])
@pytest.mark.parametrize("minimal_topk", [2, 4])
def test_minimal_topk_matches_diffusers(preset, threshold, minimal_topk):
    """minimal_topk caps the steps per block at gen_length // minimal_topk (23 and 11 of 32 at gen_length 47):
    fewer steps, each committing more, with editing off and on. Head scale 1.5 and high thresholds leave many
    commits to the schedule, so without the cap every prompt's tokens differ."""
    editing = 0.5 if preset == "llada2_1" else None
    _, _, same_steps = check_against_diffusers((17, 49, 81), 47, preset, editing, threshold, 1.5, minimal_topk)
    assert same_steps or editing is None  # editing off: diffusers spends a forward more on a block filled early


@pytest.mark.parametrize("editing_threshold, threshold", [
    (0.5, 0.7),  # the defaults: the tiny model keeps editing until the 16 + 1 refinement steps run out
    (0.9, 0.7),  # few edits: refinement ends at the first step that edits nothing
    (0.5, 1.0),  # nothing passes 1: every block fills at its 32nd step and gets no refinement step
])
@pytest.mark.parametrize("lengths, gen_length", [((5, 37, 69), 59), ((17, 49, 81), 47)])
def test_llada2_1_editing_matches_diffusers(lengths, gen_length, editing_threshold, threshold):
    """Editing on: decided tokens of the active block are replaced, blocks filled early keep refining; the tiny
    model edits, so the rule is exercised. Logits less sharp than above (head scale 1.5): no float32 ties at
    confidence 1 for the top-k to break, and confidences spread around the editing thresholds."""
    edits, edits_eos, same_steps = check_against_diffusers(lengths, gen_length, "llada2_1", editing_threshold,
                                                           threshold, 1.5)
    assert edits.sum() > 0 and edits_eos.sum() > 0
    assert same_steps  # refinement steps included: one forward each, as diffusers


class Recorder:
    """A streamer keeping what it was given: token chunks, and each draft with a copy taken on arrival."""

    def __init__(self):
        self.chunks, self.drafts = [], []

    def put(self, value):
        self.chunks.append(value.flatten().clone())

    def put_draft(self, tokens, decided):
        self.drafts.append((tokens, tokens.clone()))

    def end(self):
        pass


def test_streamed_tokens_are_final_with_editing():
    """A streamer gets a token only once its block stops refining: what it got is what the call returns, even though
    edits replaced decided tokens on the way; and it gets copies, not views of the canvas that keeps changing."""

    model, recorder = tiny_model(head_scale=1.5), Recorder()
    prompt = torch.randint(0, 90, (1, 21), generator=torch.Generator().manual_seed(3))
    cfg = BlockDiffusionConfig.from_preset("llada2_1", mask_token_id=MASK, eos_token_id=[], max_new_tokens=43)
    out = model.generate_multi_block(prompt, cfg, streamer=recorder, return_dict=True)
    assert int(out.edits.sum()) > 0
    assert torch.equal(torch.cat(recorder.chunks), out.sequences[0])
    assert all(torch.equal(given, kept) for given, kept in recorder.drafts)  # no draft changed after it was given


def test_commit_step_is_the_final_write_under_editing():
    """`commit_step` names the forward that wrote each token's final value: the last step at which the drafts show
    the position change, one fixed offset from the draft index. Edits rewrite decided tokens, so for some positions
    that step is later than the one that first decided them."""
    model, recorder = tiny_model(head_scale=1.5), Recorder()
    prompt = torch.randint(0, 90, (1, 45), generator=torch.Generator().manual_seed(5))
    cfg = BlockDiffusionConfig.from_preset("llada2_1", mask_token_id=MASK, eos_token_id=[], max_new_tokens=51)
    out = model.generate_multi_block(prompt, cfg, streamer=recorder, return_dict=True)
    drafts = [tokens for tokens, _ in recorder.drafts]
    history = torch.stack([torch.full_like(drafts[0], MASK), *drafts])
    changed = history[1:] != history[:-1]  # [steps, positions]
    steps = torch.arange(len(drafts))[:, None]
    last_write = torch.where(changed, steps, -1).amax(0)
    first_write = torch.where(changed, steps, len(drafts)).amin(0)
    assert (last_write >= 0).all()
    assert len(set((out.commit_step[0] - last_write).tolist())) == 1
    assert (last_write > first_write).any() and int(out.edits[0]) > 0
