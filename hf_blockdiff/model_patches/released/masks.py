"""Explicit attention masks, as the released generate scripts pass them.

SDAR's `generate.py` passes a float 0/1 mask of shape [1, q, k] (k counts the cached keys and the new ones), which its
modeling file applies as `mask.bool()`; Dream's `generation_utils.py` passes a boolean [b, 1, q, k] mask built from
the padding (or the string "full", see `dream.py`). So a mask of 3 or 4 dimensions says, for each query row and each
key, allowed (True / nonzero) or blocked (False / 0), and it replaces the family's own pattern for that forward.

A 4-D float mask that is not 0/1 (or holds no 1 at all) is transformers' additive mask (0 / a large negative value)
and goes to the attention implementation unchanged, as transformers passes it. A 3-D float mask must be 0/1: there is
no additive 3-D convention, and read as 0/1 an additive mask would be inverted. Per-head masks and masks whose key
length is not the one the forward attends to are refused. The allowed pattern becomes the mask the attention
implementation expects through transformers' own mask utilities (boolean for sdpa, additive for eager, a `BlockMask`
for flex); the FlashAttention implementations cannot apply an arbitrary mask and are refused.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_bidirectional_mask

from ...cache.keyword import cache_kwarg


def is_explicit_mask(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() in (3, 4)


def is_additive_mask(mask: torch.Tensor) -> bool:
    """A 4-D float mask other than 0/1 (with some 1): transformers' additive convention."""
    if mask.dim() != 4 or not mask.is_floating_point():
        return False
    return not (bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()))


def allowed_keys(mask: torch.Tensor, batch: int, query_length: int) -> torch.Tensor:
    """[batch, q, k] boolean from a [1 | batch, q, k] or [1 | batch, 1, q, k] mask (bool, or 0/1 of any dtype)."""
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"Per-head attention masks ({tuple(mask.shape)}) are not supported: use [b, 1, q, k].")
        mask = mask[:, 0]
    if mask.shape[0] not in (1, batch) or mask.shape[1] != query_length:
        raise ValueError(
            f"Attention mask of shape {tuple(mask.shape)} does not fit {batch} rows of {query_length} queries."
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                "A 3-D attention mask is read as 0/1 (1: attend, 0: blocked), as the released SDAR code reads it; "
                "this one holds other values (an additive mask?). Pass a boolean mask, or a 4-D additive one."
            )
        mask = mask != 0
    return mask.expand(batch, -1, -1)


def explicit_attention_mask(config, inputs_embeds: torch.Tensor, mask: torch.Tensor, past_key_values):
    """The attention implementation's mask for the explicit `mask`, with the keys the forward attends to (the cached
    ones included, as `past_key_values` reports them); an additive mask as is."""
    if is_additive_mask(mask):
        return mask
    implementation = config._attn_implementation
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS or "flash" in implementation:
        raise ValueError(
            f"An explicit 3-D/4-D attention mask cannot be applied by attn_implementation={implementation!r}: "
            "use 'sdpa', 'eager' or 'flex_attention'."
        )
    batch, query_length = inputs_embeds.shape[:2]
    allowed = allowed_keys(mask.to(inputs_embeds.device), batch, query_length)
    if past_key_values is None:
        (key_length, key_offset), query_offset = (query_length, 0), 0
    else:
        key_length, key_offset = past_key_values.get_mask_sizes(query_length, 0)
        query_offset = past_key_values.get_query_offset(0)
    if allowed.shape[-1] != key_length:
        raise ValueError(
            f"The attention mask covers {allowed.shape[-1]} keys but this forward attends to {key_length} "
            "(the cached keys and the new ones)."
        )

    def explicit(batch_idx, head_idx, q_idx, kv_idx):  # transformers passes absolute query and key positions
        return allowed[batch_idx, q_idx - query_offset, kv_idx - key_offset]

    return create_bidirectional_mask(
        config, inputs_embeds, None, **cache_kwarg(past_key_values), and_mask_function=explicit,
        allow_is_bidirectional_skip=False,
    )
