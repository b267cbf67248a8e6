"""diffusers' `LLaDA2Pipeline` + `BlockRefinementScheduler`: the reference decoder of the `llada2` / `llada2_1`
presets, used by `hf-blockdiff bench` on LLaDA2 models and by the equivalence tests (diffusers is an optional
dependency: the test extra has it).

The pipeline treats the model as a black box, `model(ids, attention_mask=<2-D>, position_ids=...)`, and recomputes
its whole window every step; `BlockCausalAdapter` is the glue that turns that 2-D mask into the block-causal 4-D mask
of the released model (no decoding logic).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import BlockDiffusionConfig
from ..config.checks import decoded_block_size
from ..config.profiles import model_profile


class BlockCausalAdapter(nn.Module):
    """What LLaDA2Pipeline calls as `model`: 2-D key mask over the canvas -> block-causal 4-D boolean mask; counts
    the forwards."""

    def __init__(self, model, block_size: int):
        super().__init__()
        self.model, self.block_size = model, block_size
        self.device, self.dtype = model.device, model.dtype  # read by DiffusionPipeline
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids):
        self.calls += 1
        block = torch.arange(input_ids.shape[1], device=input_ids.device) // self.block_size
        pattern = block[None, :] <= block[:, None]
        mask = pattern[None, None] & attention_mask.bool()[:, None, None, :]
        return self.model(input_ids, attention_mask=mask, position_ids=position_ids)


@torch.no_grad()
def llada2_pipeline(model, prompts: torch.Tensor, cfg: BlockDiffusionConfig, eos_token_id: int | None = None):
    """Decode `prompts` [N, P] (no padding) with the pipeline under `cfg`'s llada2 settings (greedy); returns the
    generated tokens [N, max_new_tokens] and the pipeline's forward count. An unset block size is the one
    generation takes (docs/fidelity.md, "Presets"), an unset S the block size; the pipeline caps S at
    gen_length // minimal_topk itself (its minimal_topk is at least 1)."""
    import diffusers

    block = decoded_block_size(cfg, model_profile(model))
    adapter = BlockCausalAdapter(model, block)
    pipe = diffusers.LLaDA2Pipeline(model=adapter, scheduler=diffusers.BlockRefinementScheduler())
    pipe.set_progress_bar_config(disable=True)
    out = pipe(input_ids=prompts, gen_length=cfg.max_new_tokens, block_length=block,
               num_inference_steps=cfg.steps_per_block or block, temperature=0.0, threshold=cfg.threshold,
               editing_threshold=cfg.editing_threshold, max_post_steps=cfg.max_post_steps,
               minimal_topk=cfg.minimal_topk or 1,
               eos_early_stop=eos_token_id is not None, eos_token_id=eos_token_id, mask_token_id=cfg.mask_token_id,
               output_type="seq")
    return out.sequences, adapter.calls
