"""The one-shot sum (kernels/one_shot_sum.py) against its plain reference, its ranks forked processes that share their
buffers and signal pads (CPU memory shared across a fork keeps its addresses), each launching the kernel under Triton's
interpreter at the same time, several sums back to back: the waits must hold, or a rank sums a slot before a peer's
rows arrived (a rank starts each sum later than the one before it) or after a peer pushed the next sum's rows into it.
On GPUs the kernel runs inside `row_parallel_linear`, two processes summing under load (test_distributed.py,
`test_row_parallel_sums_on_gpus_are_exact`)."""

import subprocess
import sys
import time

import pytest
import torch

from hf_blockdiff.kernels import INTERPRETED
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, buffer_bytes, one_shot_sum, one_shot_sum_reference, pad_bytes
from helpers import run_forked

pytest.importorskip("triton")
forked = pytest.mark.skipif(not INTERPRETED, reason="ranks as forked CPU processes need Triton's interpreter; on "
                            "GPUs the tests below and the two-process worker of test_distributed.py run the kernel")

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


@forked
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


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, PROGRAMS + 3])
def test_two_ranks_on_one_gpu_on_two_streams(rows):
    """Two ranks' launches on one GPU, each on a stream of its own so they run at once (32 programs fit the device;
    one compiled kernel for both ranks, since loading another while one spins would wait for it), their buffers and
    pads plain device memory: 20 sums back to back with the residual and the norm, each equal to the
    reference (the norm to bf16 rounding) on both ranks."""
    world, width, calls, slot_bytes = 2, 4096, 20, 64 * 4096 * 2
    memory = [torch.zeros(buffer_bytes(world, slot_bytes), dtype=torch.uint8, device="cuda") for _ in range(world)]
    pads = [torch.zeros(pad_bytes(world) // 8, dtype=torch.int64, device="cuda") for _ in range(world)]
    slots = torch.tensor([m.data_ptr() for m in memory], device="cuda")
    flags = torch.tensor([p.data_ptr() for p in pads], device="cuda")
    epochs = [torch.zeros(PROGRAMS, dtype=torch.int64, device="cuda") for _ in range(world)]
    generator = torch.Generator().manual_seed(rows)
    parts = [[torch.randn(rows, width, generator=generator).to("cuda", torch.bfloat16) for _ in range(world)]
             for _ in range(calls)]
    residual = torch.randn(rows, width, generator=generator).to("cuda", torch.bfloat16)
    norm = (torch.rand(width, generator=generator) + 0.5).to("cuda", torch.bfloat16)
    streams, results = [torch.cuda.Stream() for _ in range(world)], [[] for _ in range(world)]
    for call in range(calls):
        for rank in range(world):
            with torch.cuda.stream(streams[rank]):
                results[rank].append(one_shot_sum(parts[call][rank], slots, flags, epochs[rank], rank, slot_bytes,
                                                  residual, norm, EPS, timeout_s=30))
    torch.cuda.synchronize()
    for call in range(calls):
        hidden, normed = one_shot_sum_reference(parts[call], residual, norm, EPS)
        for rank in range(world):
            assert torch.equal(results[rank][call][0], hidden), f"rank {rank}, call {call}"
            torch.testing.assert_close(results[rank][call][1], normed, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
def test_a_peer_that_never_arrives_traps_the_launch():
    """A launch whose peer never signals ends with a CUDA error after its timeout (here 1 s), so the process raises
    instead of spinning: run apart, since the error ends the process's CUDA context."""
    script = """
import torch
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, buffer_bytes, one_shot_sum, pad_bytes
memory = [torch.zeros(buffer_bytes(2, 4096), dtype=torch.uint8, device="cuda") for _ in range(2)]
pads = [torch.zeros(pad_bytes(2) // 8, dtype=torch.int64, device="cuda") for _ in range(2)]
slots = torch.tensor([m.data_ptr() for m in memory], device="cuda")
flags = torch.tensor([p.data_ptr() for p in pads], device="cuda")
epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device="cuda")
one_shot_sum(torch.ones(2, 8, device="cuda"), slots, flags, epochs, 0, 4096, timeout_s=1.0)
torch.cuda.synchronize()
"""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "CUDA error" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_bad_parts_are_refused():
    part, addresses = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"residual must be \[2, 8\] torch.bfloat16"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 1024, torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="exceeds the 16-byte slot"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 16)
