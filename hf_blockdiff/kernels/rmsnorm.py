"""Fused RMSNorm: one kernel for what transformers' Llama/Qwen RMSNorm does in eight (fp32 upcast, square, mean,
rsqrt, scale, downcast, weight multiply).

y = weight · cast(x · 1/sqrt(mean(x²) + eps)) computed in fp32 and rounded as transformers does (the normalized
value is rounded to x's dtype before the weight multiply). The mean's summation order differs from torch's, so
outputs agree to rounding, not bit for bit.
"""

import torch

from . import TRITON_AVAILABLE, require_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm over the last dimension of `x` (any leading shape)."""
    require_triton("rms_norm")
    width = x.shape[-1]
    rows = x.numel() // width
    source = x.reshape(rows, width)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(width)
    per_program = max(1, min(16, 4096 // block))
    _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        source, weight, out, rows, width, source.stride(0), eps, BLOCK=block, ROWS=per_program,
        num_warps=4 if block <= 1024 else 8,
    )
    return out


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, width, stride, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < width)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=inside, other=0.0)
        h = x.to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=1) / width + eps)
        normed = (h * inv[:, None]).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        y = (w[None, :] * normed).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], y, mask=inside)
