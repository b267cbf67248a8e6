"""Attention dispatch: one function registered with transformers' `AttentionInterface` under "hf_blockdiff".

While `generate_multi_block` runs, the model's `_attn_implementation` points here and every forward carries a
`ForwardPlan` (kwarg `blockdiff_plan`); the unmodified HF attention layers call us after `Cache.update`. Outside
generation the model's own implementation is untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .cache import ForwardPlan

ATTENTION_NAME = "hf_blockdiff"


def available_backends(device: torch.device) -> tuple[str, ...]:
    return ("sdpa",)


def resolve_backend(requested: str, device: torch.device) -> str:
    available = available_backends(device)
    if requested == "auto":
        return available[-1]
    if requested not in available:
        raise ValueError(
            f"attention_backend={requested!r} is not available on {device.type} (available: {', '.join(available)})."
        )
    return requested


def blockdiff_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    blockdiff_plan: ForwardPlan | None = None,
    **kwargs,
):
    if blockdiff_plan is None:
        raise RuntimeError("The hf_blockdiff attention runs only inside generate_multi_block.")
    mask = blockdiff_plan.dense_mask(key.shape[2])
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, blockdiff_attention_forward)


@contextmanager
def blockdiff_attention(model: torch.nn.Module):
    """Route the model's attention through hf_blockdiff for the duration of the block; restore it after."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
