"""Attention for the decode step: backend objects and the one function registered with transformers.

While `generate_multi_block` runs, the model's `_attn_implementation` names `ATTENTION_NAME`, and every forward
carries the cache and the forward's plan as keyword arguments (`blockdiff_cache`, `blockdiff_plan`), as transformers'
own paged attention receives its cache; the unmodified HF attention layers pass them on to us. The function writes
the window's K/V into the cache (`PagedBlockCache.update`, the only place K/V are written) and lets the plan's
backend attend. Attentions whose steps between projecting and attending are the q/k RMSNorms and the rotary
embedding may hand over q/k as projected with `blockdiff_rotary` (cos, sin, norm weights or None, eps): the cache
applies those steps in the kernel that writes (`PagedBlockCache.update_rotary`,
`fusion/layers.py`). Outside generation the model's own implementation is untouched.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from ..cache import ForwardPlan, PagedBlockCache
from .backends import AttentionBackend, available_backends, resolve_backend

ATTENTION_NAME = "hf_blockdiff"


@torch.compiler.disable
def blockdiff_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    blockdiff_cache: PagedBlockCache | None = None,
    blockdiff_plan: ForwardPlan | None = None,
    blockdiff_rotary: tuple | None = None,
    **kwargs,
):
    if blockdiff_plan is None or blockdiff_cache is None:
        raise RuntimeError("The hf_blockdiff attention runs only inside generate_multi_block.")
    layer = module.layer_idx
    if blockdiff_rotary is None:
        key, value = blockdiff_cache.update(key, value, layer, {"plan": blockdiff_plan})
    else:  # query and key as projected: the cache normalizes and rotates them as it writes
        query, key, value = blockdiff_cache.update_rotary(query, key, value, layer, blockdiff_plan, blockdiff_rotary)
    sliding = kwargs.get("sliding_window") is not None  # Gemma-style layers pass their window (None: full)
    return blockdiff_plan.backend.attend(query, key, value, blockdiff_cache, layer, blockdiff_plan, scaling,
                                         sliding), None


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, blockdiff_attention_forward)


__all__ = ["ATTENTION_NAME", "AttentionBackend", "available_backends", "blockdiff_attention_forward", "register",
           "resolve_backend"]
