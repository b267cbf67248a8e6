"""The `llada2` preset against diffusers' LLaDA2Pipeline + BlockRefinementScheduler (editing off, greedy, fp32).

diffusers runs one prompt at a time through a thin adapter (glue only: the pipeline passes a 2-D mask over the
canvas, the adapter turns it into the block-causal 4-D mask the released model expects, keys marked 0 removed);
`generate_multi_block` decodes all prompts as one left-padded batch. Prompt + new tokens end on a block boundary:
diffusers hides the canvas past `P + gen_length` from every key (its 2-D mask), the released `generate` and we do
not, so only there the last block could differ (docs/design.md, "Presets")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

diffusers = pytest.importorskip("diffusers")

MASK, PAD, BLOCK = 95, 92, 32


def tiny_model():
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
        model.lm_head.weight.mul_(6.0)  # sharp logits, so the 0.7 threshold fires
        model.lm_head.weight[MASK] = 0.0  # logit 0 where the others reach tens: the mask is never proposed
    return model


class BlockCausalAdapter(nn.Module):
    """What LLaDA2Pipeline calls as `model`: 2-D mask over the canvas -> block-causal 4-D boolean mask."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.device, self.dtype = model.device, model.dtype  # read by DiffusionPipeline

    def forward(self, input_ids, attention_mask, position_ids):
        index = torch.arange(input_ids.shape[1])
        pattern = (index[None, :] // BLOCK) <= (index[:, None] // BLOCK)
        mask = pattern[None, None] & attention_mask.bool()[:, None, None, :]
        return self.model(input_ids, attention_mask=mask, position_ids=position_ids)


def diffusers_tokens(model, prompt, gen_length, eos):
    pipe = diffusers.LLaDA2Pipeline(model=BlockCausalAdapter(model), scheduler=diffusers.BlockRefinementScheduler())
    pipe.set_progress_bar_config(disable=True)
    out = pipe(input_ids=prompt[None], gen_length=gen_length, block_length=BLOCK, num_inference_steps=32,
               temperature=0.0, threshold=0.7, editing_threshold=None, minimal_topk=1, eos_early_stop=eos is not None,
               eos_token_id=eos, mask_token_id=MASK, output_type="seq")
    return out.sequences[0]


def ours(model, prompts, gen_length, eos):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    attention_mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], attention_mask[row, width - len(prompt):] = prompt, 1
    cfg = BlockDiffusionConfig.from_preset("llada2", max_new_tokens=gen_length, mask_token_id=MASK,
                                           eos_token_id=eos if eos is not None else [], pad_token_id=PAD)
    return model.generate_multi_block(ids, cfg, attention_mask=attention_mask)[:, width:]


def _prompts(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("lengths, gen_length", [((5, 37, 69), 59), ((17, 49, 81), 47)])
def test_llada2_preset_matches_diffusers(lengths, gen_length):
    model, prompts = tiny_model(), _prompts(lengths, seed=sum(lengths))
    without_eos = ours(model, prompts, gen_length, None)
    for row, prompt in enumerate(prompts):
        assert without_eos[row].tolist() == diffusers_tokens(model, prompt, gen_length, None).tolist()
    eos = int(without_eos[0, gen_length // 3])  # a token the model emits mid-way: the EOS rule is exercised
    with_eos = ours(model, prompts, gen_length, eos)
    stopped = 0
    for row, prompt in enumerate(prompts):
        expected, got = diffusers_tokens(model, prompt, gen_length, eos), with_eos[row]
        hits = (expected == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else gen_length  # diffusers leaves whatever follows its EOS
        assert got[:end].tolist() == expected[:end].tolist()
        assert (got[end:] == PAD).all()
        stopped += len(hits) > 0
    assert stopped > 0
