"""The skinny GEMMs' `invariant` launches (batch_invariant decoding): any row count, rows tiled by INVARIANT_BLOCK_M
with one tile configuration per weight shape, so a row's output is the same bits whatever rows share the call.
Reference: `torch.nn.functional.linear` (and the other ops' references beside the kernel)."""

import pytest
import torch

from hf_blockdiff.kernels.skinny_gemm import (
    gated_linear, gated_linear_reference, grouped_linear, grouped_linear_reference, linear_residual,
    linear_residual_reference,
)

pytest.importorskip("triton")


def _inputs(device, dtype, rows, width, outs, seed):
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, width, generator=generator, device=device).to(dtype)
    weights = [(torch.randn(n, width, generator=generator, device=device) / width**0.5).to(dtype) for n in outs]
    return x, weights


def _ops(x, weights, residual):
    """name → (op, reference), each on a slice of x's rows (and of `residual` [rows, N] beside them); the op
    invariant."""
    nones, up = [None] * len(weights), weights[0].flip(0)
    return {
        "grouped": (lambda rows: torch.cat(grouped_linear(x[rows], weights, nones, invariant=True), 1),
                    lambda rows: torch.cat(grouped_linear_reference(x[rows], weights, nones), 1)),
        "gated": (lambda rows: gated_linear(x[rows], weights[0], up, invariant=True),
                  lambda rows: gated_linear_reference(x[rows], weights[0], up)),
        "residual": (lambda rows: linear_residual(x[rows], weights[0], None, residual[rows], invariant=True),
                     lambda rows: linear_residual_reference(x[rows], weights[0], None, residual[rows])),
    }


def _rows_alone_and_among_others(op, counts):
    """Rows 0..count-1 computed in calls of every count in `counts`, all against the widest call's rows: a row's bits
    must not change with how many rows share its call, nor with its place in its row tile."""
    widest = op(slice(0, max(counts)))
    for count in counts:
        assert torch.equal(op(slice(0, count)), widest[:count]), f"rows 0..{count} differ computed among {count} rows"
    for row in (0, max(counts) - 1):  # alone, where it sits first in its tile
        assert torch.equal(op(slice(row, row + 1)), widest[row:row + 1]), f"row {row} alone differs"


@pytest.mark.parametrize("op", ["grouped", "gated", "residual"])
def test_rows_are_independent_of_their_batch(op, assert_close):
    """CPU under TRITON_INTERPRET=1 (float32): 1, 5, 17 and 70 rows (70: two row tiles), each row bit-identical
    whatever rows share its call, and equal to the reference to tolerance."""
    x, weights = _inputs("cpu", torch.float32, 70, 96, (48, 24), seed=3)
    residual = torch.randn(70, 48, generator=torch.Generator().manual_seed(4))
    invariant, _ = _ops(x, weights, residual)[op]
    _, reference = _ops(x.double(), [w.double() for w in weights], residual.double())[op]
    _rows_alone_and_among_others(invariant, (1, 5, 17, 70))
    assert_close(invariant(slice(None)), reference(slice(None)), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("width,outs", [(2560, (9728,)), (2560, (151936,)), (2560, (4096, 1024, 1024)),
                                        (9728, (2560,))], ids=["gate-up", "lm-head", "qkv", "down"])
def test_rows_are_independent_of_their_batch_gpu(width, outs, assert_close):
    """bf16 at SDAR-4B's widths (the LM head 2560×151936): rows 1, 3, 64, 130 and 512."""
    x, weights = _inputs("cuda", torch.bfloat16, 512, width, outs, seed=width)
    residual = torch.randn(512, outs[0], device="cuda", dtype=torch.bfloat16)
    for name, (invariant, reference) in _ops(x, weights, residual).items():
        if name == "gated" and len(outs) > 1:
            continue
        _rows_alone_and_among_others(invariant, (1, 3, 64, 130, 512))
        assert_close(invariant(slice(None)), reference(slice(None)).double(), torch.bfloat16)
