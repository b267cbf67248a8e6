"""The one-shot sum (kernels/one_shot_sum.py) against its plain reference, its ranks forked processes that share their
buffers and signal pads (CPU memory shared across a fork keeps its addresses), each launching the kernel under Triton's
interpreter at the same time, several sums back to back: the waits must hold, or a rank sums a slot before a peer's
rows arrived (a rank starts each sum later than the one before it). The interpreter runs a rank's programs one after
another, so no peer can push the next sum's rows while a program still reads: that each epoch pushes into a slot of
its own is tested with the peer played by the test. On GPUs: two ranks on two streams of one device, a peer that
never arrives, and the kernel inside `row_parallel_linear`, two processes summing under load (test_distributed.py,
`test_row_parallel_sums_on_gpus_are_exact`)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_blockdiff.kernels import INTERPRETED
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, one_shot_sum, one_shot_sum_reference
from helpers import on_python_path, one_shot_group, run_forked

pytest.importorskip("triton")
forked = pytest.mark.skipif(not INTERPRETED, reason="ranks as forked CPU processes need Triton's interpreter; on "
                            "GPUs the tests below and the two-process worker of test_distributed.py run the kernel")

STAGGER_S, CALLS, EPS, TIMEOUT_S = 0.05, 3, 1e-6, 30.0


def _rank(rank, shared, parts, residual, norm, outs, normed, epochs):
    """One rank: CALLS sums, each started STAGGER_S·rank late; its epochs copied out."""
    slots, pads, slot_bytes = shared
    mine = torch.zeros(PROGRAMS, dtype=torch.int64)
    for call in range(CALLS):
        time.sleep(STAGGER_S * rank)
        hidden, y = one_shot_sum(parts[call][rank], slots, pads, mine, rank, slot_bytes, residual, norm, EPS,
                                 TIMEOUT_S)
        outs[rank][call].copy_(hidden)
        if y is not None:
            normed[rank][call].copy_(y)
    epochs[rank].copy_(mine)


def run_ranks(parts: list[list[torch.Tensor]], residual, norm) -> tuple:
    """Every rank's sums and norms of `parts` [call][rank] from forked processes; every rank's pad and epochs after."""
    world, (rows, width), dtype = len(parts[0]), parts[0][0].shape, parts[0][0].dtype
    slot_bytes = rows * width * parts[0][0].element_size() + 64
    memory, pads, slots, flags = one_shot_group(world, slot_bytes)  # the memory held while the ranks run
    shared = (slots, flags, slot_bytes)
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
    memory, pads, slots, flags = one_shot_group(world, slot_bytes, "cuda")  # held while the ranks run
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
                                                  residual, norm, EPS, TIMEOUT_S))
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
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, one_shot_sum
from helpers import one_shot_group
memory, pads, slots, flags = one_shot_group(2, 4096, "cuda")
epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device="cuda")
one_shot_sum(torch.ones(2, 8, device="cuda"), slots, flags, epochs, 0, 4096, None, None, 0.0, 1.0)
torch.cuda.synchronize()
"""
    started = time.monotonic()
    env = on_python_path(dict(os.environ), Path(__file__).resolve().parents[1])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0 and "CUDA error" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_each_epoch_pushes_into_a_slot_of_its_own(device):
    """Rank 0 of two, its peer played by the test (its rows pushed into rank 0's slot of the epoch's parity, its flags
    set to the epoch): two sums, each adding the rows of its own epoch's slot; the second pushes into the peer's other
    slot, so the first's rows are still there for a peer still reading them; the flags and epochs count two."""
    world, rows, width = 2, 3, 40
    slot_bytes = rows * width * 4
    memory, pads, slots, flags = one_shot_group(world, slot_bytes, device)
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
    generator = torch.Generator().manual_seed(5)
    mine, theirs = ([torch.randn(rows, width, generator=generator).to(device) for _ in range(2)] for _ in range(2))

    def slot(rank: int, parity: int, source: int) -> torch.Tensor:
        start = (parity * world + source) * (slot_bytes // 4)
        return memory[rank].view(torch.float32)[start: start + rows * width].view(rows, width)

    for call, epoch in enumerate((1, 2)):
        slot(0, epoch % 2, 1).copy_(theirs[call])
        pads[0].view(PROGRAMS, world)[:, 1] = epoch
        hidden, _ = one_shot_sum(mine[call], slots, flags, epochs, 0, slot_bytes, None, None, 0.0, TIMEOUT_S)
        assert torch.equal(hidden, one_shot_sum_reference([mine[call], theirs[call]])[0]), f"sum {call}"
    assert torch.equal(slot(1, 1, 0), mine[0]) and torch.equal(slot(1, 0, 0), mine[1])
    assert bool((pads[1].view(PROGRAMS, world)[:, 0] == 2).all()) and bool((epochs == 2).all())


def test_bad_parts_are_refused():
    part, addresses = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"residual must be \[2, 8\] torch.bfloat16"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 1024, torch.zeros(2, 4, dtype=torch.bfloat16), None, 0.0,
                     TIMEOUT_S)
    with pytest.raises(ValueError, match="exceeds the 16-byte slot"):
        one_shot_sum(part, addresses, addresses, epochs, 0, 16, None, None, 0.0, TIMEOUT_S)
