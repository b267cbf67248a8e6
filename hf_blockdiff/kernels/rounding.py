"""Rounding inside Triton kernels, the same on GPUs and under TRITON_INTERPRET (whose bf16 casts truncate)."""

from . import TRITON_AVAILABLE

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
