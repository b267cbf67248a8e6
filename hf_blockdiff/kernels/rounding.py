"""Numerics inside Triton kernels, the same on GPUs and under TRITON_INTERPRET: rounding to a dtype (the
interpreter's bf16 casts truncate) and the GEMM kernels' tile products (the interpreter multiplies bf16 tiles as raw
bits)."""

import torch

from . import INTERPRETED, TRITON_AVAILABLE


def ieee_products(dtype: torch.dtype) -> bool:
    """`dot_t`'s IEEE flag for tiles of `dtype`: fp32 multiplies in IEEE fp32 (no TF32), and under the interpreter
    every dtype goes to fp32 first (bf16 products are exact in fp32, as on the tensor cores, so only the summation
    order differs)."""
    return dtype == torch.float32 or INTERPRETED

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def round_bf16(x):
        """fp32 x rounded to the nearest bfloat16 (ties to even), as float32, by bit arithmetic."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """fp32 x rounded to `dtype` as a cast to it rounds on GPUs (bf16 by bit arithmetic), as float32."""
        if dtype == tl.bfloat16:
            return round_bf16(x)
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def dot_t(x, w, acc, IEEE: tl.constexpr):
        """acc + x·wᵀ, IEEE as `ieee_products` says."""
        if IEEE:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)
