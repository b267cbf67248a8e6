"""The one-shot sum (kernels/one_shot_sum.py) against its plain reference, its ranks forked processes that share their
buffers and signal pads (CPU memory shared across a fork keeps its addresses), each launching the kernel under Triton's
interpreter at the same time, several sums back to back: the waits must hold, or a rank sums a slot before a peer's
rows arrived (a rank starts each sum later than the one before it) or after a peer pushed the next sum's rows into it.
On GPUs the kernel runs inside `row_parallel_linear`, two processes summing under load (test_distributed.py,
`test_row_parallel_sums_on_gpus_are_exact`)."""

import time

import pytest
import torch

from hf_blockdiff.kernels import INTERPRETED
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, buffer_bytes, one_shot_sum, one_shot_sum_reference, pad_bytes
from helpers import run_forked

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="ranks as forked CPU processes need Triton's interpreter; "
                                "on GPUs the two-process worker of test_distributed.py runs the kernel")

STAGGER_S, CALLS, EPS = 0.05, 3, 1e-6


def _rank(rank, shared, parts, residual, norm, outs, normed, epochs):
    """One rank: CALLS sums, each started STAGGER_S·rank late; its epochs copied out."""
    slots, pads, slot_bytes = shared
    mine = torch.zeros(PROGRAMS, dtype=torch.int64)
    for call in range(CALLS):
        time.sleep(STAGGER_S * rank)
        hidden, y = one_shot_sum(parts[call][rank], slots, pads, mine, rank, slot_bytes, residual, norm, EPS)
        outs[rank][call].copy_(hidden)
        if y is not None:
            normed[rank][call].copy_(y)
    epochs[rank].copy_(mine)


def run_ranks(parts: list[list[torch.Tensor]], residual, norm) -> tuple:
    """Every rank's sums and norms of `parts` [call][rank] from forked processes; every rank's pad and epochs after."""
    world, (rows, width), dtype = len(parts[0]), parts[0][0].shape, parts[0][0].dtype
    slot_bytes = rows * width * parts[0][0].element_size() + 64
    memory = [torch.zeros(buffer_bytes(world, slot_bytes), dtype=torch.uint8).share_memory_() for _ in range(world)]
    pads = [torch.zeros(pad_bytes(world) // 8, dtype=torch.int64).share_memory_() for _ in range(world)]
    shared = (torch.tensor([m.data_ptr() for m in memory]), torch.tensor([p.data_ptr() for p in pads]), slot_bytes)
    outs = torch.zeros(world, CALLS, rows, width, dtype=dtype).share_memory_()
    normed = torch.zeros(world, CALLS, rows, width).share_memory_()
    epochs = torch.zeros(world, PROGRAMS, dtype=torch.int64).share_memory_()
    run_forked(_rank, [(r, shared, parts, residual, norm, outs, normed, epochs) for r in range(world)])
    return outs, normed, pads, epochs


@pytest.mark.parametrize("world, rows, dtype", [(2, 5, torch.bfloat16), (3, PROGRAMS + 3, torch.float32)],
                         ids=["two-ranks-bf16", "three-ranks-rows-looped-fp32"])
@pytest.mark.parametrize("epilogue", ["sum", "residual", "norm"])
def test_every_rank_holds_the_sum_in_rank_order(world, rows, dtype, epilogue):
    """Each rank's result of each call equals the reference bit for bit (the norm to fp32 rounding), every rank the
    same; every program counted CALLS launches and every flag says so."""
    width = 48
    generator = torch.Generator().manual_seed(world * rows)
    parts = [[(torch.randn(rows, width, generator=generator) * 4).to(dtype) for _ in range(world)]
             for _ in range(CALLS)]
    residual = (torch.randn(rows, width, generator=generator) * 4).to(dtype) if epilogue != "sum" else None
    norm = torch.rand(width, generator=generator) + 0.5 if epilogue == "norm" else None
    outs, normed, pads, epochs = run_ranks(parts, residual, norm)
    for call in range(CALLS):
        hidden, want = one_shot_sum_reference(parts[call], residual, norm, EPS)
        for rank in range(world):
            assert torch.equal(outs[rank][call], hidden), f"rank {rank}'s sum of call {call}"
            if norm is not None:
                torch.testing.assert_close(normed[rank][call], want, rtol=1e-6, atol=1e-6)
    assert bool((epochs == CALLS).all())
    for rank, pad in enumerate(pads):  # a flag per program and peer, its own never written
        flags = pad.view(PROGRAMS, world)
        assert bool((flags[:, rank] == 0).all()) and int((flags == CALLS).sum()) == PROGRAMS * (world - 1)


def test_bad_parts_are_refused():
    part, addresses = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"residual must be \[2, 8\] torch.bfloat16"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 1024, torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="exceeds the 16-byte slot"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 16)
