"""A call's prompts, checked before any forward (docs/design.md, "Errors"): left padding, ids inside the vocabulary,
lengths that fit the model. Without an `attention_mask`, leading pad ids are padding, as transformers' `generate`
infers its mask, unless the pad id is also a stop id or the mask id (then it cannot tell: it warns once)."""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..config import BlockDiffusionConfig
from .engine import plan_shapes

logger = logging.get_logger(__name__)


def prompts_of(input_ids: torch.Tensor, attention_mask, cfg: BlockDiffusionConfig,
               vocab_size: int | None) -> list[torch.Tensor]:
    """Each row's prompt without its left padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_length] (tokenizer(..., "
                         "return_tensors='pt').input_ids).")
    if attention_mask is None:
        attention_mask = _inferred_mask(input_ids, cfg)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask is a {type(attention_mask).__name__}: pass a torch.Tensor of shape "
                         f"{tuple(input_ids.shape)} (tokenizer(..., return_tensors='pt').attention_mask), or None.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids has {tuple(input_ids.shape)}.")
    mask = attention_mask.bool().to(input_ids.device)
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "attention_mask is right-padded (or has holes): generate_multi_block needs left padding. "
            "Set tokenizer.padding_side = 'left'."
        )
    _check_vocabulary(input_ids, mask, vocab_size)
    lengths = mask.sum(-1).tolist()
    return [row[len(row) - n :] for row, n in zip(input_ids, lengths)]


def _inferred_mask(input_ids: torch.Tensor, cfg: BlockDiffusionConfig) -> torch.Tensor:
    pad = cfg.pad_token_id
    leading = (input_ids == pad).long().cumprod(-1).bool()  # the run of pad ids each row starts with
    if not bool(leading.any()):
        return torch.ones_like(input_ids, dtype=torch.bool)
    if pad in cfg.stop_ids or pad == cfg.mask_token_id:
        logger.warning_once(
            f"input_ids start with the pad id {pad}, which is also a stop or mask id, and no attention_mask was "
            "given: those positions are decoded as prompt. Pass the tokenizer's attention_mask for a left-padded batch."
        )
        return torch.ones_like(input_ids, dtype=torch.bool)
    return ~leading


def _check_vocabulary(input_ids: torch.Tensor, mask: torch.Tensor, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    outside = mask & ((input_ids < 0) | (input_ids >= vocab_size))
    if bool(outside.any()):
        row, position = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"input_ids[{row}, {position}] = {int(input_ids[row, position])} is outside the model's vocabulary "
            f"[0, {vocab_size}): encode the prompts with the model's own tokenizer."
        )


def check_lengths(model, prompts: list[torch.Tensor], cfg: BlockDiffusionConfig) -> None:
    if any(len(p) == 0 for p in prompts):
        raise ValueError("Every row needs at least one prompt token (a row of attention_mask is all zeros).")
    limit = getattr(model.config, "max_position_embeddings", None)
    longest, _ = plan_shapes([len(p) for p in prompts], cfg)
    if limit is not None and longest > limit:
        raise ValueError(
            f"The longest prompt plus max_new_tokens={cfg.max_new_tokens} (rounded up to whole blocks: {longest} "
            f"positions) exceeds the model's max_position_embeddings={limit}: lower max_new_tokens or shorten the prompt."
        )
