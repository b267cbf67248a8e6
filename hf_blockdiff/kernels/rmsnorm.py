"""Fused RMSNorm: one kernel for what transformers' Llama/Qwen RMSNorm does in eight (fp32 upcast, square, mean,
rsqrt, scale, downcast, weight multiply); `add_rms_norm` also adds the residual before it, as a decoder layer does
after its attention (the sum rounded to x's dtype, as torch's add rounds it, and returned beside the norm).

y = weight · cast(x · 1/sqrt(mean(x²) + eps)) computed in fp32 and rounded as transformers does (the normalized
value is rounded to x's dtype before the weight multiply). The mean's summation order differs from torch's, so
outputs agree to rounding, not bit for bit.
"""

import torch

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, RMSNorm of it), as a transformers decoder layer computes its residual stream and next norm."""
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm over the last dimension of `x` (any leading shape)."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Triton (x + delta, RMSNorm of it) over the last dimension (x and delta of one shape and dtype)."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta must match x: {list(x.shape)} {x.dtype}, got {list(delta.shape)} {delta.dtype}")
    return _launch(x, delta, weight, eps)


def _rows(x: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (the kernel's layout)."""
    flat = x.reshape(rows, width)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch(x, delta, weight, eps):
    require_triton("rms_norm")
    width = x.shape[-1]
    rows = x.numel() // width
    source = _rows(x, rows, width)
    added = _rows(delta, rows, width) if delta is not None else source
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else x
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(width)
    per_program = max(1, min(16, 4096 // block))
    launch(_rms_norm_kernel, (triton.cdiv(rows, per_program),),
        source, added, weight, total, out, rows, width, source.stride(0), added.stride(0), eps, BLOCK=block,
        ROWS=per_program, HAS_DELTA=delta is not None, num_warps=4 if block <= 1024 else 8,
    )
    return total, out


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .rounding import round_to

    @triton.jit
    def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, t_ptr, y_ptr, n_rows, width, stride, d_stride, eps, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, HAS_DELTA: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < width)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=inside, other=0.0)
        h = x.to(tl.float32)
        if HAS_DELTA:  # the residual sum, rounded as torch rounds it (round_to: also under the interpreter)
            d = tl.load(d_ptr + rows[:, None].to(tl.int64) * d_stride + cols[None, :], mask=inside, other=0.0)
            h = round_to(h + d.to(tl.float32), x.dtype)
            tl.store(t_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], h.to(x.dtype), mask=inside)
        inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=1) / width + eps)
        normed = round_to(h * inv[:, None], x.dtype)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        y = (w[None, :] * normed).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], y, mask=inside)
