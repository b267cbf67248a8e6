"""Rotary write: what a Qwen-style attention does between its q/k/v projections and attending, in one launch.

rotary_write(query, key, value, cos, sin, key_pages, value_pages, slots, q_weight, k_weight, eps) applies the q/k
RMSNorms over each head (when weights are given), then the rotary embedding (rotate-half layout), to the projected
queries and keys; it writes each token's keys and values into the page pools at its flat slot and returns the
queries. transformers runs this as the norms' eight elementwise steps per tensor, the rotary's five, a transpose copy
and an `index_copy` for each of K and V (or, compiled, one or two fused kernels and the four eager copies).

Rounded as transformers rounds: the normalized value to the dtype before the weight multiply, then the weighted
value, each rotary product and their sum (bf16 by bit arithmetic, so TRITON_INTERPRET rounds as GPUs do). The mean's
summation order differs from torch's, so outputs agree to rounding, not bit for bit.

Shapes: query [T, Hq, D], key and value [T, Hkv, D] (heads and dims contiguous), cos and sin [T, D], pools
[num_pages, page_size, Hkv, D], slots [T] (flat pool slot of each token; padding tokens share a scratch slot).
"""

import torch

from . import INTERPRETED, TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .dependent_launch import dependent_launch, launch_options
from .rmsnorm import rms_norm_reference

INTERPRETED_TOKENS = 64  # tokens a program under TRITON_INTERPRET, whose cost is per program and op


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_write_reference(query, key, value, cos, sin, key_pages, value_pages, slots, q_weight=None, k_weight=None,
                           eps=1e-6) -> torch.Tensor:
    """transformers' Qwen3 attention steps (RMSNorm over head_dim, `apply_rotary_pos_emb`) and the cache's write."""
    if q_weight is not None:
        query, key = rms_norm_reference(query, q_weight, eps), rms_norm_reference(key, k_weight, eps)
    cos, sin = cos[:, None], sin[:, None]
    key_pages.view(-1, *key_pages.shape[2:]).index_copy_(0, slots, _rotate(key, cos, sin))
    value_pages.view(-1, *value_pages.shape[2:]).index_copy_(0, slots, value)
    return _rotate(query, cos, sin)


def _check(query, key, value, cos, key_pages, slots) -> None:
    tokens, _, dim = query.shape
    if key.shape != value.shape or key.shape[0] != tokens or key.shape[2] != dim or dim % 2:
        raise ValueError(f"query [T, Hq, D] and key, value [T, Hkv, D] with an even D, got {list(query.shape)}, "
                         f"{list(key.shape)}, {list(value.shape)}")
    if cos.shape != (tokens, dim) or slots.shape != (tokens,):
        raise ValueError(f"cos and sin must be [{tokens}, {dim}] and slots [{tokens}], got {list(cos.shape)} and "
                         f"{list(slots.shape)}")
    if key_pages.shape[2:] != key.shape[1:] or not key_pages.is_contiguous():
        raise ValueError(f"the page pools must be contiguous [pages, page_size, {key.shape[1]}, {dim}], got "
                         f"{list(key_pages.shape)}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError(f"{name}'s heads and dims must be contiguous (strides [*, {dim}, 1]), got {t.stride()}")


def rotary_write(query, key, value, cos, sin, key_pages, value_pages, slots, q_weight=None, k_weight=None,
                 eps=1e-6) -> torch.Tensor:
    """The Triton kernel of `rotary_write_reference`: returns the queries [T, Hq, D], contiguous."""
    require_triton("rotary_write")
    _check(query, key, value, cos, key_pages, slots)
    tokens, q_heads, dim = query.shape
    kv_heads = key.shape[1]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    heads = min(8, triton.next_power_of_2(max(q_heads, kv_heads)))
    q_groups = triton.cdiv(q_heads, heads)
    normed = q_weight is not None
    overlap = dependent_launch(query.device)
    block = min(INTERPRETED_TOKENS, triton.next_power_of_2(tokens)) if INTERPRETED else 1
    launch(_rotary_write_kernel, (triton.cdiv(tokens, block), q_groups + triton.cdiv(kv_heads, heads)),
        query, key, value, cos, sin, q_weight if normed else cos, k_weight if normed else cos, out, key_pages,
        value_pages, slots, tokens, query.stride(0), key.stride(0), value.stride(0), q_heads, kv_heads, q_groups, eps,
        DIM=dim, HALF=triton.next_power_of_2(dim // 2), HEADS=heads, NORMED=normed, TOKENS=block, GDC=overlap,
        num_warps=4, **launch_options(overlap),
    )
    return out


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .dependent_launch import follow_previous
    from .rounding import round_to

    @triton.jit
    def _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, heads, cols, inside, eps, DIM: tl.constexpr,
                        NORMED: tl.constexpr, DTYPE: tl.constexpr, TOKENS: tl.constexpr):
        """[HEADS, HALF] (or [TOKENS, HEADS, HALF], where x_ptr, cos_ptr and sin_ptr are [TOKENS, 1, 1]) low and high
        halves of the heads at x_ptr, normed and rotated (float32, rounded)."""
        half = DIM // 2
        lo = tl.load(x_ptr + heads[:, None] * DIM + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + heads[:, None] * DIM + half + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if NORMED:
            inv = 1.0 / tl.sqrt_rn((tl.sum(lo * lo, axis=-1) + tl.sum(hi * hi, axis=-1)) / DIM + eps)
            w_lo = tl.load(w_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
            w_hi = tl.load(w_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
            lo = round_to(w_lo[None, :] * round_to(lo * tl.expand_dims(inv, -1), DTYPE), DTYPE)
            hi = round_to(w_hi[None, :] * round_to(hi * tl.expand_dims(inv, -1), DTYPE), DTYPE)
        cos_lo = _row(cos_ptr, cols, half, TOKENS)
        cos_hi = _row(cos_ptr + half, cols, half, TOKENS)
        sin_lo = _row(sin_ptr, cols, half, TOKENS)
        sin_hi = _row(sin_ptr + half, cols, half, TOKENS)
        out_lo = round_to(round_to(lo * cos_lo, DTYPE) - round_to(hi * sin_lo, DTYPE), DTYPE)
        out_hi = round_to(round_to(hi * cos_hi, DTYPE) + round_to(lo * sin_hi, DTYPE), DTYPE)
        return out_lo, out_hi

    @triton.jit
    def _row(ptr, cols, half, TOKENS: tl.constexpr):
        """The `half` values at ptr, float32: [1, HALF], or [TOKENS, 1, HALF] from ptr [TOKENS, 1, 1]."""
        if TOKENS == 1:
            row = tl.load(ptr + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        else:
            row = tl.load(ptr + cols[None, None, :], mask=cols[None, None, :] < half, other=0.0).to(tl.float32)
        return row

    @triton.jit
    def _inside(heads, count, cols, real, DIM: tl.constexpr, TOKENS: tl.constexpr):
        """Which of the tile's elements are real: heads below `count`, columns below DIM / 2 (and tokens in range)."""
        inside = (heads[:, None] < count) & (cols[None, :] < DIM // 2)
        if TOKENS > 1:
            inside = inside & real
        return inside

    @triton.jit
    def _program_tokens(tokens, TOKENS: tl.constexpr):
        """The program's token: a scalar (one token a program, as compiled for GPUs), or under the interpreter a
        [TOKENS, 1, 1] block of them, each clamped into range (the stores' masks leave out the block's tail), and
        whether it is in range."""
        token = tl.program_id(0).to(tl.int64)
        real = token < tokens  # unused with one token a program (the grid has no more programs than tokens)
        if TOKENS > 1:
            token = token * TOKENS + tl.arange(0, TOKENS)[:, None, None]
            real = token < tokens
            token = tl.minimum(token, tokens - 1)
        return token, real

    @triton.jit(do_not_specialize=["tokens"])
    def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, out_ptr, kpool_ptr, vpool_ptr,
                             slots_ptr, tokens, q_stride, k_stride, v_stride, q_heads, kv_heads, q_groups, eps,
                             DIM: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, NORMED: tl.constexpr,
                             TOKENS: tl.constexpr, GDC: tl.constexpr):
        """Program (t, g): head group g of token t (of tokens t·TOKENS onwards), a group of query heads
        (g < q_groups) or of key/value heads."""
        follow_previous(GDC)
        token, real = _program_tokens(tokens, TOKENS)
        group = tl.program_id(1)
        cols = tl.arange(0, HALF)
        cos_ptr += token * DIM
        sin_ptr += token * DIM
        if group < q_groups:
            heads = group * HEADS + tl.arange(0, HEADS)
            inside = _inside(heads, q_heads, cols, real, DIM, TOKENS)
            lo, hi = _normed_rotated(q_ptr + token * q_stride, qw_ptr, cos_ptr, sin_ptr, heads, cols, inside, eps,
                                     DIM, NORMED, out_ptr.dtype.element_ty, TOKENS)
            target = out_ptr + token * q_heads * DIM
        else:
            heads = (group - q_groups) * HEADS + tl.arange(0, HEADS)
            inside = _inside(heads, kv_heads, cols, real, DIM, TOKENS)
            lo, hi = _normed_rotated(k_ptr + token * k_stride, kw_ptr, cos_ptr, sin_ptr, heads, cols, inside, eps,
                                     DIM, NORMED, out_ptr.dtype.element_ty, TOKENS)
            slot = tl.load(slots_ptr + token).to(tl.int64) * kv_heads * DIM
            offsets = heads[:, None] * DIM + cols[None, :]
            for half in tl.static_range(2):
                v = tl.load(v_ptr + token * v_stride + offsets + half * (DIM // 2), mask=inside)
                tl.store(vpool_ptr + slot + offsets + half * (DIM // 2), v, mask=inside)
            target = kpool_ptr + slot
        offsets = heads[:, None] * DIM + cols[None, :]
        tl.store(target + offsets, lo.to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(target + offsets + DIM // 2, hi.to(out_ptr.dtype.element_ty), mask=inside)
