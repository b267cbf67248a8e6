"""FlashAttention over the paged cache: every batch row is one block-sized chunk whose queries all see the row's keys
[0, length) (non-causal), read through the page table from the page pools as they are ([pages, page_size, kv_heads,
head_dim], FlashAttention's paged layout). The installed FlashAttention is used: FA3
(`flash_attn_interface.flash_attn_with_kvcache`), FA2 (`flash_attn.flash_attn_with_kvcache`; its pages hold a
multiple of 256 tokens) or FA4 (`flash_attn.cute.flash_attn_varlen_func` with `page_table` and `seqused_k`).
`flash_paged_reference` is that contract in plain torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FlashKernel:
    name: str
    page_multiple: int  # page sizes it accepts: multiples of this
    run: Callable  # (q [N, S, H, D], k_pages, v_pages, lengths [N] int32, page_table [N, P] int32, scale) -> like q


def _with_kvcache(fn, q, k_pages, v_pages, lengths, page_table, scale):
    return fn(q, k_pages, v_pages, cache_seqlens=lengths, block_table=page_table, softmax_scale=scale, causal=False)


def _varlen(fn, q, k_pages, v_pages, lengths, page_table, scale):
    out = fn(q, k_pages, v_pages, seqused_k=lengths, page_table=page_table, softmax_scale=scale, causal=False)
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def load() -> FlashKernel | None:
    """The installed FlashAttention's paged entry point (FA3, then FA2, then FA4), or None."""
    try:
        from flash_attn_interface import flash_attn_with_kvcache

        return FlashKernel("flash-attn 3", 1, functools.partial(_with_kvcache, flash_attn_with_kvcache))
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_with_kvcache

        return FlashKernel("flash-attn 2", 256, functools.partial(_with_kvcache, flash_attn_with_kvcache))
    except ImportError:
        pass
    try:
        from flash_attn.cute import flash_attn_varlen_func

        return FlashKernel("flash-attn 4", 1, functools.partial(_varlen, flash_attn_varlen_func))
    except ImportError:
        return None


def flash_paged_reference(q, k_pages, v_pages, lengths, page_table, scale):
    """Query i of row n attends to keys [0, lengths[n]) of the row's pages (GQA: query head h reads kv head
    h // (H / kv_heads))."""
    page_size = k_pages.shape[1]
    positions = torch.arange(page_table.shape[1] * page_size, device=q.device)
    slots = page_table[:, positions // page_size].long() * page_size + positions % page_size
    k, v = (pool.flatten(0, 1)[slots].transpose(1, 2) for pool in (k_pages, v_pages))
    visible = (positions[None, :] < lengths[:, None].long())[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
